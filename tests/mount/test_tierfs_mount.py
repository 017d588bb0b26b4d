"""tierfs through a real FUSE mount: what a loader sees, the control file from a shell, restarts."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tierfs.testing.harness import force_unmount, mounted, wait_until, within


def _listed_files(mnt: str) -> list[str]:
    out = []
    for d in sorted(os.listdir(mnt)):
        for name in os.listdir(os.path.join(mnt, d)):
            out.append(f"{d}/{name}")
    return out


def _wait_pushed(m, timeout: float = 30.0) -> None:
    """Until the current and the next mini-epoch are in the kernel page cache (pushed after staging)."""
    deadline = time.monotonic() + timeout
    while True:
        st = m.status()
        if st["pushed_bytes"] >= st["view_bytes"] + st["prefetch"]["bytes_total"]:
            return
        assert time.monotonic() < deadline, f"pushes did not finish: {st}"
        time.sleep(0.05)


def _wait_next_ready(m, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not m.status()["next_ready"]:
        assert time.monotonic() < deadline, "staging did not finish"
        time.sleep(0.02)


def _text(path: str) -> str:
    with open(path) as f:
        return f.read()


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_passes_over_the_mount_read_correct_bytes(tierfs_mount, dataset):
    backing, files = dataset
    total = sum(files.values())
    with tierfs_mount(capacity=total // 2, nm=4, rf=2) as m:
        assert ".tierfs" not in os.listdir(m.mountpoint)
        assert sorted(os.listdir(m.mountpoint)) == sorted({r.split("/")[0] for r in files})
        seen = set()
        for _ in range(8):  # one epoch: 4 mini-epochs x 2 passes
            _wait_next_ready(m)  # so that advance=ready switches after exactly rf passes, whatever the load
            listed = _listed_files(m.mountpoint)
            order = _text(m.path(".tierfs", "order")).splitlines()
            assert sorted(order) == sorted(listed)
            for rel in listed:
                assert _digest(m.path(rel)) == _digest(os.path.join(backing, rel))
            seen.update(listed)
        st = m.status()
        assert seen == set(files)
        assert st["cache_bytes"] <= st["cache_capacity"]
        assert st["reads"]["hits"] > 0 and st["epoch"] == 1 and st["rf_effective"][:4] == [2, 2, 2, 2]
        # every path resolves, in view or not
        for rel in files:
            assert os.path.getsize(m.path(rel)) == files[rel]
        other = next(r for r in files if r not in _listed_files(m.mountpoint))
        assert _digest(m.path(other)) == _digest(os.path.join(backing, other))
        assert m.status()["reads"]["out_of_view"] >= 1


def test_mount_is_read_only_and_backing_untouched(tierfs_mount, dataset):
    backing, files = dataset
    before = {r: os.stat(os.path.join(backing, r)) for r in files}
    with tierfs_mount(capacity="1M") as m:
        rel = next(iter(files))
        p = m.path(rel)
        d = m.path(rel.split("/")[0])
        def opens(path: str, flags: int) -> None:
            os.close(os.open(path, flags, 0o644))

        attempts = [
            lambda: opens(p, os.O_RDWR),
            lambda: opens(p, os.O_WRONLY | os.O_TRUNC),
            lambda: opens(os.path.join(d, "new"), os.O_WRONLY | os.O_CREAT),
            lambda: os.mkdir(os.path.join(d, "sub")),
            lambda: os.unlink(p),
            lambda: os.rmdir(d),
            lambda: os.rename(p, p + ".x"),
            lambda: os.chmod(p, 0o777),
            lambda: os.truncate(p, 0),
            lambda: os.symlink("x", os.path.join(d, "l")),
            lambda: os.link(p, os.path.join(d, "h")),
            lambda: os.setxattr(p, "user.x", b"1"),
            lambda: os.utime(p, (0, 0)),
        ]
        for attempt in attempts:
            with pytest.raises(OSError) as exc:
                attempt()
            assert exc.value.errno == errno.EROFS, (attempt, exc.value)
        assert not os.access(p, os.W_OK) and os.access(p, os.R_OK)
    after = {r: os.stat(os.path.join(backing, r)) for r in files}
    assert {r: (s.st_size, s.st_mtime_ns, s.st_mode) for r, s in before.items()} == {
        r: (s.st_size, s.st_mtime_ns, s.st_mode) for r, s in after.items()}


def test_control_from_a_shell_and_status_while_staging(tierfs_mount, dataset):
    _, files = dataset
    with tierfs_mount(capacity=sum(files.values()) // 2, nm=4, rf=2, bandwidth="2M") as m:
        ctl = m.path(".tierfs", "control")
        assert subprocess.run(["sh", "-c", f"echo rf=3 > {ctl}"]).returncode == 0
        assert m.status()["rf"] == 3
        r = subprocess.run(["bash", "-c", f"echo nm=0 > {ctl}"], capture_output=True, text=True)
        assert r.returncode != 0 and "Invalid argument" in r.stderr
        with pytest.raises(OSError) as exc:
            m.control("rf=7\nnm=0\n")  # one write, one bad item: nothing changes
        assert exc.value.errno == errno.EINVAL
        st = m.status()
        assert st["rf"] == 3 and "nm" in st["last_error"]
        assert "rf=3" in _text(ctl).splitlines()
        with pytest.raises(OSError) as exc:
            m.control("cache=/tmp/elsewhere\n")
        assert exc.value.errno == errno.EINVAL
        # status is one complete JSON object on every read, while staging and passes move the engine
        stop = threading.Event()
        errors: list[Exception] = []

        def poll():
            while not stop.is_set():
                try:
                    with open(m.path(".tierfs", "status"), "rb", buffering=0) as f:
                        chunks = []
                        while part := f.read(64):  # small reads: the snapshot must hold across them
                            chunks.append(part)
                    json.loads(b"".join(chunks))
                except Exception as e:
                    errors.append(e)
                time.sleep(0.002)

        th = threading.Thread(target=poll)
        th.start()
        try:
            for _ in range(3):
                for rel in _listed_files(m.mountpoint):
                    with open(m.path(rel), "rb") as f:
                        f.read()
                m.control("next-pass\n")
        finally:
            stop.set()
            th.join()
        assert not errors
        metrics = _text(m.path(".tierfs", "metrics"))
        assert "tierfs_cache_bytes" in metrics and "# TYPE tierfs_epoch gauge" in metrics


def test_symlinks_are_shown_as_symlinks(dataset, mount_dirs, tmp_path):
    backing, _files = dataset
    (tmp_path / "outside.txt").write_text("never staged")
    os.symlink(tmp_path / "outside.txt", backing / "class_000" / "escape")
    os.symlink("file_00000.bin", backing / "class_000" / "alias")
    mnt, cache = mount_dirs
    with mounted(backing, mnt, cache, "1M") as m:
        assert os.readlink(m.path("class_000", "escape")) == str(tmp_path / "outside.txt")
        assert os.readlink(m.path("class_000", "alias")) == "file_00000.bin"
        assert os.path.islink(m.path("class_000", "alias"))
        # a relative link inside the dataset resolves through the mount itself
        assert _digest(m.path("class_000", "alias")) == _digest(os.path.join(backing, "class_000",
                                                                            "file_00000.bin"))
    for name in os.listdir(os.path.join(cache, "data")):
        assert os.path.getsize(os.path.join(cache, "data", name)) != len("never staged") or True
    assert all(oct(os.stat(os.path.join(cache, "data", n)).st_mode & 0o777) == "0o600"
               for n in os.listdir(os.path.join(cache, "data")))
    assert oct(os.stat(cache).st_mode & 0o777) == "0o700"


def test_changed_backing_file_is_served_new_through_the_kernel(tierfs_mount, dataset):
    backing, files = dataset
    with tierfs_mount(capacity="4M", nm=1, rf=100, revalidate="open") as m:
        rel = next(iter(files))
        assert _digest(m.path(rel)) == _digest(os.path.join(backing, rel))
        time.sleep(0.01)
        with open(os.path.join(backing, rel), "wb") as f:
            f.write(b"a longer, different content " * 1000)
        with open(m.path(rel), "rb") as f:
            assert f.read() == b"a longer, different content " * 1000
        os.unlink(os.path.join(backing, rel))
        with pytest.raises(FileNotFoundError):
            os.open(m.path(rel), os.O_RDONLY)


def test_killed_daemon_restart_resumes_position_and_cache(tierfs_mount, dataset, mount_dirs):
    backing, files = dataset
    mnt, cache = mount_dirs
    total = sum(files.values())
    with tierfs_mount(capacity=total // 2, nm=4, rf=2) as m:
        for _ in range(3):
            for rel in _listed_files(m.mountpoint):
                with open(m.path(rel), "rb") as f:
                    f.read()
        time.sleep(0.5)  # let staging of the next mini-epoch land
        before = m.status()
        m.process.send_signal(signal.SIGKILL)
        m.process.wait(timeout=10)
        force_unmount(mnt)
    kept_names = set(os.listdir(os.path.join(cache, "data")))
    with tierfs_mount(capacity=total // 2, nm=4, rf=2) as m:
        after = m.status()
        assert (after["epoch"], after["mini_epoch"], after["pass"]) == (
            before["epoch"], before["mini_epoch"], before["pass"])
        assert after["cache_bytes"] > 0
        assert {n for n in os.listdir(os.path.join(cache, "data")) if not n.startswith(".tmp-")} & kept_names
        for rel in _listed_files(m.mountpoint):
            assert _digest(m.path(rel)) == _digest(os.path.join(backing, rel))


def test_data_path_tuning_keeps_reads_whole(tierfs_mount, dataset):
    # flush answers ENOSYS (the kernel then stops sending it), the read-ahead is widened (as root), and cold or
    # warm, small or large reads of cached copies return every byte.
    backing, files = dataset
    with tierfs_mount(capacity="4M", policy="lru", view="full") as m:
        dev = os.stat(m.mountpoint).st_dev
        if os.geteuid() == 0:  # (set by a worker thread once the kernel has the INIT reply: wait for it)
            ra = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
            wait_until(lambda: Path(ra).read_text().strip() == "4096", timeout=30, what=f"{ra} to read 4096")
        for rel in files:  # the first reads stage the copies (lru: read-through)
            assert _digest(m.path(rel)) == _digest(os.path.join(backing, rel))
        assert m.status()["reads"]["misses"] == len(files)
        for rel in files:
            fd = os.open(m.path(rel), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the kernel's pages: next read is served
                data = b"".join(iter(lambda fd=fd: os.read(fd, 3000), b""))
            finally:
                os.close(fd)  # must not fail although flush is ENOSYS
            with open(os.path.join(backing, rel), "rb") as f:
                assert data == f.read()
        assert m.status()["reads"]["hits"] == len(files)


def test_staged_mini_epoch_is_pushed_into_the_page_cache_and_never_served_stale(tierfs_mount, dataset):
    # The next mini-epoch's copies are pushed into the kernel page cache (notify_store) once staged, so its first
    # pass sends no READ to the daemon; a backing change still reaches the reader, never the pushed bytes.  (The
    # daemon's read path: under passthrough the kernel reads the copies themselves and nothing is pushed.)
    backing, files = dataset
    with tierfs_mount(capacity="4M", nm=2, rf=100, revalidate="open", passthrough="off") as m:
        for rel in files:
            os.stat(m.path(rel))  # the kernel learns every inode (a push needs one)
        _wait_next_ready(m)
        _listed_files(m.mountpoint)  # readdirplus: pushes that found no inode are retried
        _wait_pushed(m)
        before = m.status()
        m.control("advance")
        assert m.status()["mini_epoch"] != before["mini_epoch"]
        listed = _listed_files(m.mountpoint)
        assert listed
        for rel in listed:
            assert _digest(m.path(rel)) == _digest(os.path.join(backing, rel))
        after = m.status()
        assert after["served_bytes"] == before["served_bytes"]  # every byte came from the page cache
        assert after["opened_bytes"] - before["opened_bytes"] == sum(files[rel] for rel in listed)
        assert after["reads"]["hits"] - before["reads"]["hits"] == len(listed)
        rel = listed[0]
        path = os.path.join(backing, rel)
        with open(path, "rb") as f:
            old = f.read()
        new = bytes(b ^ 0x5A for b in old)  # same size, other bytes
        with open(path, "wb") as f:
            f.write(new)
        os.utime(path, ns=(1, 1))
        with open(m.path(rel), "rb") as f:
            assert f.read() == new
        with open(m.path(rel), "rb") as f:
            assert f.read() == new


def _unquote_order_line(line: bytes) -> bytes:
    """The documented rule of ``order``: a line in double quotes is a C-quoted path (\\\\, \\", \\n, \\r)."""
    if not line.startswith(b'"'):
        return line
    out, i, body = bytearray(), 0, line[1:-1]
    while i < len(body):
        if body[i : i + 1] == b"\\":
            out += {b"n": b"\n", b"r": b"\r"}.get(body[i + 1 : i + 2], body[i + 1 : i + 2])
            i += 2
        else:
            out += body[i : i + 1]
            i += 1
    return bytes(out)


def test_order0_carries_every_name_and_order_quotes_what_a_line_cannot(tmp_path):
    backing, mnt, cache = tmp_path / "backing", tmp_path / "mnt", tmp_path / "cache"
    names = [b"plain.bin", b"new\nline.bin", b"carriage\rreturn.bin", b'"starts with a quote.bin', b"back\\slash.bin",
             b"sp ace.bin", "ünï.bin".encode(), b"-dash.bin", b"d/in a dir\n.bin"]
    for name in names:
        path = os.path.join(os.fsencode(backing), name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(name)
    mnt.mkdir()
    with mounted(backing, mnt, cache, "1M", view="full"):
        order0 = (mnt / ".tierfs" / "order0").read_bytes()
        order = (mnt / ".tierfs" / "order").read_bytes()
        assert order0.endswith(b"\0")
        paths = order0[:-1].split(b"\0")
        assert sorted(paths) == sorted(names)  # every name, as it is, in one serving order
        lines = order[:-1].split(b"\n")
        assert len(lines) == len(names)  # one line per file: no name is split
        assert [_unquote_order_line(ln) for ln in lines] == paths  # the same order, decoded
        # only what a line cannot carry is quoted: an unquoted line is the path itself and opens as it is
        assert {ln for ln in lines if ln.startswith(b'"')} == {
            b'"new\\nline.bin"', b'"carriage\\rreturn.bin"', b'"\\"starts with a quote.bin"', b'"d/in a dir\\n.bin"'}
        for p in paths + [ln for ln in lines if not ln.startswith(b'"')]:
            with open(os.path.join(os.fsencode(mnt), p), "rb") as f:
                assert f.read() == p


def _copy_descriptors(pid: int, cache: str) -> int:
    """Descriptors the daemon holds on files of its cache dir's ``data/`` (copies)."""
    data = os.path.join(os.path.realpath(cache), "data") + os.sep
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        n += target.startswith(data)
    return n


@pytest.mark.alone  # (it drops the kernel's caches, every mount's: others count their requests, page-cache hits)
def test_an_open_of_pushed_bytes_holds_no_copy_until_a_read_reaches_the_daemon(tierfs_mount, dataset, mount_dirs):
    # Opens of files whose bytes the kernel was given pin their copies without opening them: a loader holding
    # many open costs the daemon no descriptors.  Once the kernel drops the pages, the reads that reach the daemon
    # open the copy then -- and a copy damaged meanwhile is repaired, its bytes read from the backing file.  (The
    # daemon's read path: under passthrough nothing is pushed.)
    backing, files = dataset
    _, cache = mount_dirs
    with tierfs_mount(capacity="4M", nm=2, rf=100, passthrough="off") as m:
        for rel in files:
            os.stat(m.path(rel))  # the kernel learns every inode (a push needs one)
        _wait_next_ready(m)
        _listed_files(m.mountpoint)
        _wait_pushed(m)
        m.control("advance")
        listed = _listed_files(m.mountpoint)
        pid = m.process.pid
        held = [open(m.path(rel), "rb", buffering=0) for rel in listed]  # noqa: SIM115 (held open on purpose)
        try:
            assert _copy_descriptors(pid, cache) == 0
            before = m.status()
            for rel, f in zip(listed, held, strict=True):
                assert within(m.mountpoint, f.readall) == files_bytes(backing, rel)
            assert m.status()["served_bytes"] == before["served_bytes"]  # all from the mount's page cache
            assert _copy_descriptors(pid, cache) == 0
            # The kernel lets the pages go: the next reads reach the daemon, which opens each copy now.
            copy = os.getxattr(m.path(listed[0]), "user.tierfs.cache_path")
            with open(copy, "r+b") as c:  # (same size, other bytes: the copy is no longer what was committed)
                c.write(bytes(b ^ 0xFF for b in c.read(16)))
            with open("/proc/sys/vm/drop_caches", "w") as dc:
                dc.write("1\n")
            for rel, f in zip(listed, held, strict=True):
                f.seek(0)
                assert within(m.mountpoint, f.readall) == files_bytes(backing, rel)
            after = m.status()
            assert after["served_bytes"] > before["served_bytes"]
            assert after["cache_repairs"] == before["cache_repairs"] + 1  # the damaged copy, found at its read
            # (each handle whose pages went opened its copy; the damaged one reads the backing file instead)
            assert 1 <= _copy_descriptors(pid, cache) <= len(held) - 1
        finally:
            for f in held:
                f.close()
        wait_until(lambda: _copy_descriptors(pid, cache) == 0, what="the copies' descriptors closed")


def files_bytes(backing: Path | str, rel: str) -> bytes:
    with open(os.path.join(backing, rel), "rb") as f:
        return f.read()

"""A ``view=full`` mount looks like its backing dir to tar, rsync -aH, du and find: hard links share an inode,
FIFOs, sockets and device nodes are listed as what they are and never opened through tierfs (issue 22, 6)."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import subprocess
import sys

import pytest

from tierfs.testing.harness import mounted

DEADLINE = 20.0  # seconds any one command on the mount may take before the test calls it hung


def _run(cmd: list[str], **kw) -> str:
    return subprocess.run(cmd, capture_output=True, check=True, timeout=DEADLINE, **kw).stdout.decode(
        errors="surrogateescape")


@pytest.fixture
def odd_backing(dataset):
    """The dataset plus a file with three names, a symlink, a FIFO, a unix socket and (as root) a device node."""
    backing, _ = dataset
    (backing / "links").mkdir()
    (backing / "links" / "one.bin").write_bytes(b"linked bytes " * 100)
    os.link(backing / "links" / "one.bin", backing / "links" / "two.bin")
    os.link(backing / "links" / "one.bin", backing / "class_001" / "three.bin")
    os.symlink("one.bin", backing / "links" / "sym")
    special = backing / "special"
    special.mkdir()
    os.mkfifo(special / "fifo")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(special / "sock"))
    has_dev = False
    with contextlib.suppress(PermissionError):
        os.mknod(special / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        has_dev = True
    return backing, has_dev


def _find(root) -> list[str]:
    return sorted(_run(["find", str(root), "-printf", "%y %n %s %m %U %G %T@ %P %l\\n"]).splitlines())


def _tar(root) -> list[str]:
    out = subprocess.run(f"tar --sort=name -C {root} -cf - . 2>/dev/null | tar -tvf -", shell=True,
                         capture_output=True, check=True, timeout=DEADLINE).stdout.decode(errors="surrogateescape")
    return out.splitlines()


def test_view_full_is_the_backing_to_tar_rsync_du_and_find(odd_backing, mount_dirs, tmp_path):
    backing, has_dev = odd_backing
    mnt, cache = mount_dirs
    with mounted(backing, mnt, cache, "1M", view="full") as m:
        names = [m.path("links", "one.bin"), m.path("links", "two.bin"), m.path("class_001", "three.bin")]
        sts = [os.stat(p) for p in names]
        assert {st.st_ino for st in sts} == {sts[0].st_ino} and {st.st_nlink for st in sts} == {3}
        for p in names:
            with open(p, "rb") as f:
                assert f.read() == b"linked bytes " * 100
        special = {n: os.lstat(m.path("special", n)).st_mode for n in os.listdir(m.path("special"))}
        assert stat.S_ISFIFO(special["fifo"]) and stat.S_ISSOCK(special["sock"])
        if has_dev:
            st = os.lstat(m.path("special", "null"))
            assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)

        assert _find(mnt) == _find(backing)
        assert _run(["du", "-s", "--block-size=1", str(mnt)]).split()[0] == \
            _run(["du", "-s", "--block-size=1", str(backing)]).split()[0]
        tar_mount = _tar(mnt)
        assert tar_mount == _tar(backing)
        assert any(" link to " in line for line in tar_mount)  # stored once, as hard links
        copy = tmp_path / "copy"
        subprocess.run(["cp", "-a", str(backing), str(copy)], check=True, timeout=DEADLINE)
        assert _run(["rsync", "-aHn", "-i", f"{mnt}/", f"{copy}/"]).strip() == ""


def test_special_files_are_never_opened_through_tierfs(odd_backing, mount_dirs):
    """The kernel answers opens of a FIFO, socket or device itself (tierfs is never asked): the mount's FIFO is
    a pipe of the mount, never the backing's -- a non-blocking open answers at once, a writer without a reader
    gets ENXIO, and while a reader holds it open the backing's FIFO still has no reader."""
    backing, has_dev = odd_backing
    mnt, cache = mount_dirs
    with mounted(backing, mnt, cache, "1M", view="full") as m:
        probe = """
import errno, os, sys
fifo, backing_fifo, sock = sys.argv[1:4]
fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
assert os.read(fd, 10) == b""
try:
    os.open(backing_fifo, os.O_WRONLY | os.O_NONBLOCK)
    print("backing fifo has a reader")
except OSError as exc:
    assert exc.errno == errno.ENXIO, exc
os.close(fd)
for path, flags in ((fifo, os.O_WRONLY | os.O_NONBLOCK), (sock, os.O_RDONLY)):
    try:
        os.close(os.open(path, flags))
        print("opened", path)
    except OSError as exc:
        print(errno.errorcode[exc.errno])
"""
        out = subprocess.run([sys.executable, "-c", probe, m.path("special", "fifo"),
                              str(backing / "special" / "fifo"), m.path("special", "sock")],
                             capture_output=True, text=True, timeout=DEADLINE)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["ENXIO", "ENXIO"]
        if has_dev:  # a device node of the dataset is no door to this host's devices (mounted nodev)
            with pytest.raises(OSError) as exc:
                os.close(os.open(m.path("special", "null"), os.O_RDONLY))
            assert exc.value.errno == errno.EACCES
        assert m.status()["epoch"] >= 0  # the daemon answers, nothing of it waited on the FIFO


def test_default_view_lists_special_files_and_keeps_each_name_a_file(odd_backing, mount_dirs):
    """In the mini-epoch view each name is a dataset file of its own (its own inode, one link); special files
    are listed like symlinks, in every mini-epoch."""
    backing, _ = odd_backing
    mnt, cache = mount_dirs
    with mounted(backing, mnt, cache, "1M", nm=4) as m:
        assert stat.S_ISFIFO(os.lstat(m.path("special", "fifo")).st_mode)
        assert {"fifo", "sock"} <= set(os.listdir(m.path("special")))
        sts = [os.stat(m.path("links", "one.bin")), os.stat(m.path("links", "two.bin"))]
        assert sts[0].st_ino != sts[1].st_ino and sts[0].st_nlink == sts[1].st_nlink == 1

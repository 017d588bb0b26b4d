"""A ``view=full`` mount looks like the backing dir to standard tools (issues 11 and 14).

diff, rsync, tar and find -- tools nobody here wrote -- compare the mount with the backing dir over a tree with
odd names (blanks, unicode, a newline, a leading dash, a backslash), empty dirs, 0-byte and block-boundary
files, symlinks (relative, absolute, dangling) and modes of every kind: they must see no difference.  And the
mount refuses every change with EROFS, leaving the backing dir as it was.
"""

from __future__ import annotations

import errno
import os
import subprocess

import pytest

from tierfs.testing.harness import mounted


def _odd_tree(root) -> None:
    names = ["plain", "with space", "ünïcödé-名前", "new\nline", "-leading-dash", "back\\slash", "tab\there"]
    for i, name in enumerate(names):
        d = root / f"dir{i}"
        d.mkdir(parents=True)
        for size in (0, 1, 4095, 4096, 4097, 65536):
            (d / f"{name}-{size}").write_bytes(os.urandom(size))
        (d / name).write_bytes(b"x" * (i + 1))
        os.chmod(d / name, (0o600, 0o644, 0o755, 0o400, 0o640, 0o750, 0o444)[i])
        os.symlink(f"{name}-1", d / f"{name}.rel")
    (root / "empty").mkdir()
    (root / "empty" / "nested-empty").mkdir()
    os.symlink("/etc/hostname", root / "abs-link")
    os.symlink("does/not/exist", root / "dangling")
    os.symlink("../..", root / "dir0" / "up-up")
    os.chmod(root / "dir1", 0o750)


def _run(*args: str) -> str:
    out = subprocess.run(args, capture_output=True, timeout=120)
    assert out.returncode == 0, (args, out.stderr.decode(errors="replace"))
    return out.stdout.decode(errors="surrogateescape")


def test_diff_rsync_tar_and_find_see_no_difference(tmp_path):
    backing, mnt = tmp_path / "b", tmp_path / "m"
    _odd_tree(backing)
    mnt.mkdir()
    with mounted(backing, mnt, tmp_path / "c", "16M", nm=1, view="full") as m:
        _run("diff", "-r", "--no-dereference", str(backing), str(mnt))
        changes = _run("rsync", "-a", "--checksum", "-n", "-i", f"{backing}/", f"{mnt}/")
        assert changes.strip() == "", changes
        listing = {}
        for name, root in (("backing", backing), ("mount", mnt)):
            listing[name] = _run("find", str(root), "-mindepth", "1", "-printf", r"%P %s %m %T@ %l %b %y\0")
        assert sorted(listing["backing"].split("\0")) == sorted(listing["mount"].split("\0"))
        tars = {}
        for name, root in (("backing", backing), ("mount", mnt)):
            tars[name] = subprocess.run(
                f"tar --numeric-owner --sort=name -C '{root}' -cf - . | tar -tvf -", shell=True,
                capture_output=True, check=True, timeout=120).stdout
        assert tars["backing"] == tars["mount"]
        du = [_run("du", "-s", "--apparent-size", str(r)).split()[0] for r in (backing, mnt)]
        assert du[0] == du[1]
        assert m.process.poll() is None


MUTATIONS = {
    "create": lambda p: os.open(p + ".new", os.O_WRONLY | os.O_CREAT, 0o644),
    "write": lambda p: os.open(p, os.O_WRONLY),
    "truncate": lambda p: os.truncate(p, 0),
    "unlink": os.unlink,
    "rename": lambda p: os.rename(p, p + ".moved"),
    "chmod": lambda p: os.chmod(p, 0o777),
    "chown": lambda p: os.chown(p, 1, 1),
    "utime": lambda p: os.utime(p, (1, 1)),
    "mkdir": lambda p: os.mkdir(p + ".d"),
    "symlink": lambda p: os.symlink("x", p + ".l"),
    "link": lambda p: os.link(p, p + ".h"),
    "setxattr": lambda p: os.setxattr(p, "user.x", b"1"),
    "removexattr": lambda p: os.removexattr(p, "user.x"),
    "mknod": lambda p: os.mknod(p + ".fifo", 0o600 | 0o010000),
}


@pytest.mark.parametrize("target", ["dir0/plain", "dir0", ".tierfs/status", ".tierfs/order", ".tierfs/metrics",
                                    ".tierfs/control"])
def test_every_change_is_refused_and_the_backing_stays_as_it_was(tmp_path, target):
    backing, mnt = tmp_path / "b", tmp_path / "m"
    _odd_tree(backing)
    mnt.mkdir()
    before = _run("find", str(backing), "-printf", r"%P %s %m %T@ %C@\0")
    with mounted(backing, mnt, tmp_path / "c", "16M", nm=1, view="full") as m:
        path = m.path(target)
        for what, call in MUTATIONS.items():
            if target == ".tierfs/control" and what == "write":
                continue  # the one change allowed: control writes
            with pytest.raises(OSError) as exc:
                fd = call(path)
                if isinstance(fd, int):
                    os.close(fd)
            expected = {errno.EROFS}
            if target == "dir0":
                expected |= {errno.EISDIR, errno.EPERM}  # the kernel's own answers for directories
            if target.startswith(".tierfs"):
                expected |= {errno.EACCES, errno.EPERM}  # the control files: not writable, not removable
            if what == "removexattr":
                expected |= {errno.ENODATA}  # nothing to remove (still nothing changed)
            assert exc.value.errno in expected, (what, target, exc.value)
        assert m.process.poll() is None
    assert _run("find", str(backing), "-printf", r"%P %s %m %T@ %C@\0") == before


def test_df_and_findmnt_see_a_read_only_dataset_never_a_full_disk(tmp_path):
    backing, mnt = tmp_path / "b", tmp_path / "m"
    _odd_tree(backing)
    mnt.mkdir()
    with mounted(backing, mnt, tmp_path / "c", "16M", nm=1, view="full"):
        v, b = os.statvfs(mnt), os.statvfs(backing)
        # the backing's figures (others write to that disk meanwhile: free space within 1 %), never "100 % full"
        assert v.f_blocks == b.f_blocks and abs(v.f_bavail - b.f_bavail) <= b.f_blocks // 100
        assert v.f_bavail > 0
        assert not v.f_flag & os.ST_RDONLY  # rw to the kernel (the control file is writable), EROFS otherwise
    with mounted(backing, mnt, tmp_path / "c2", "16M", nm=1, view="full", ro=True) as m:
        assert os.statvfs(mnt).f_flag & os.ST_RDONLY
        assert "ro" in _run("findmnt", "-no", "OPTIONS", str(mnt)).strip().split(",")
        with pytest.raises(OSError) as exc:
            m.control("rf=3\n")
        assert exc.value.errno == errno.EROFS
        assert m.status()["view_files"] > 0
        _run("diff", "-r", "--no-dereference", str(backing), str(mnt))

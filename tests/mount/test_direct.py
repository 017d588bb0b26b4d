"""Direct reads of cached copies (``tierfs.direct``) through a real mount: lent only when safe, always correct."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from tierfs.direct import CACHE_PATH_XATTR, cached_path, open_cached
from tierfs.testing.harness import mounted, wait_until


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()




def _listed(mnt: str) -> list[str]:
    out = []
    for d in sorted(os.listdir(mnt)):
        out += [f"{d}/{n}" for n in os.listdir(os.path.join(mnt, d))]
    return out


def test_direct_reads_lend_cached_copies_and_count_as_opens(tierfs_mount, dataset):
    backing, files = dataset
    with tierfs_mount(capacity=sum(files.values()) // 2, nm=4, rf=2) as m:
        wait_until(lambda: m.status()["next_ready"])
        st0 = m.status()
        view = _listed(m.mountpoint)
        assert 0 < len(view) == st0["view_files"] < len(files)
        cache_data = os.path.realpath(os.path.join(m.cache, "data"))
        for rel in view:
            copy = cached_path(m.path(rel))
            assert copy is not None and os.path.dirname(copy) == cache_data
            assert _read(copy) == _read(os.path.join(backing, rel))
        st = m.status()
        assert st["reads"]["direct"] == len(view)
        assert st["reads"]["hits"] - st0["reads"]["hits"] == len(view)
        assert st["reads"]["misses"] == st0["reads"]["misses"]
        # every file of the view lent once: that was a whole pass, as if each had been opened
        assert st["passes_total"] == st0["passes_total"] + 1
        assert st["served_bytes"] == st0["served_bytes"]  # not one byte went through the daemon
        assert st["opened_bytes"] - st0["opened_bytes"] == sum(files[r] for r in view)
        summary = subprocess.run([sys.executable, "-m", "tierfs", "status", m.mountpoint], capture_output=True,
                                 text=True, check=True, timeout=60).stdout
        assert f"{len(view)} direct" in summary


def test_open_cached_falls_back_to_the_mount(tierfs_mount, dataset, tmp_path):
    backing, files = dataset
    with tierfs_mount(capacity=sum(files.values()) // 4, nm=10, rf=2) as m:
        wait_until(lambda: m.status()["next_ready"])
        in_view = set(_listed(m.mountpoint))
        # every file reads correctly, lent or not (out of view and not staged: through the mount)
        lent = 0
        for rel in sorted(files):
            lent += cached_path(m.path(rel)) is not None
            with open_cached(m.path(rel)) as f:
                assert f.read() == _read(os.path.join(backing, rel))
        assert len(in_view) <= lent < len(files)
        assert m.status()["reads"]["misses"] > 0
        # the control files, directories and unknown attributes have no such attribute
        for p in (m.path(".tierfs", "status"), m.path(sorted(in_view)[0].split("/")[0]), m.mountpoint):
            assert cached_path(p) is None
        with pytest.raises(OSError) as exc:
            os.getxattr(m.path(sorted(in_view)[0]), b"user.other")
        assert exc.value.errno == errno.ENODATA
        # setting it is refused like every change
        with pytest.raises(OSError) as exc:
            os.setxattr(m.path(sorted(in_view)[0]), CACHE_PATH_XATTR, b"/etc/passwd")
        assert exc.value.errno == errno.EROFS
    # not a tierfs mount: a plain open
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"abc")
    assert cached_path(plain) is None
    with open_cached(plain) as f:
        assert f.read() == b"abc"
    with pytest.raises(ValueError, match="reads only"):
        open_cached(plain, "r+b")


def test_a_changed_backing_file_is_never_lent(tierfs_mount, dataset):
    backing, files = dataset
    with tierfs_mount(capacity=sum(files.values()), policy="lru", revalidate="open") as m:
        rel = sorted(files)[3]
        assert cached_path(m.path(rel)) is None  # not cached yet
        _read(m.path(rel))  # read through: now it is
        assert cached_path(m.path(rel)) is not None
        new = b"changed in the backing dir\n" * 100
        with open(os.path.join(backing, rel), "wb") as f:
            f.write(new)
        assert cached_path(m.path(rel)) is None  # the cached copy is stale: not lent
        with open_cached(m.path(rel)) as f:
            assert f.read() == new  # the mount notices the change on open and serves the new bytes


def test_other_users_are_not_lent_copies(dataset, tmp_path, other_user):
    backing, files = dataset
    mnt, as_nobody = other_user
    with mounted(backing, mnt, tmp_path / "cache", sum(files.values()), policy="lru", allow_other=True) as m:
        rel = sorted(files)[0]
        _read(m.path(rel))
        assert cached_path(m.path(rel)) is not None  # root is lent the copy
        code = ("import errno, os, sys\n"
                "try:\n    print(os.getxattr(sys.argv[1], b'user.tierfs.cache_path'))\n"
                "except OSError as e:\n    print(errno.errorcode[e.errno])\n"
                "print(len(open(sys.argv[1], 'rb').read()))\n")
        assert as_nobody(code, m.path(rel)) == ["ENODATA", str(files[rel])]

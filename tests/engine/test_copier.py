"""One copy into the cache (tierfs.daemon.staging.copier), on real files: whole or not at all, never a version it was
not asked for, and no more calls on the backing file than one open, the reads and one fstat (counted by strace)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import xxhash

from sampler.atomic import TEMP_PREFIX
from tierfs.common.protocol import COPY_MTIME_NS
from tierfs.daemon.cache.store import cache_block
from tierfs.daemon.staging.copier import BackingChanged, copy_into_cache
from tierfs.daemon.tree.tree import fingerprint


@pytest.fixture
def dirs(tmp_path):
    backing, data = tmp_path / "backing", tmp_path / "data"
    backing.mkdir()
    data.mkdir()
    root = os.open(backing, os.O_RDONLY | os.O_DIRECTORY)
    dfd = os.open(data, os.O_RDONLY | os.O_DIRECTORY)
    yield backing, data, root, dfd
    os.close(root)
    os.close(dfd)


def _copy(dirs, name: bytes, expected, serial=1, *, hash_content=False):
    backing, data, root, dfd = dirs
    st = os.stat(backing / os.fsdecode(name))
    return copy_into_cache(root, st.st_dev, name, expected, dfd, serial, sparse=st.st_blocks * 512 < st.st_size,
                           hash_content=hash_content, throttle=None, block=cache_block(str(data)))


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 110 << 10, (1 << 20) + 3, (3 << 20)])
def test_a_copy_is_the_file_byte_for_byte(dirs, size):
    backing, data, _, _ = dirs
    content = os.urandom(size)
    (backing / "f").write_bytes(content)
    fp = fingerprint(os.stat(backing / "f"))
    copied = _copy(dirs, b"f", fp, hash_content=True)
    assert copied.fp == fp
    assert (data / copied.name).read_bytes() == content
    assert copied.digest == xxhash.xxh3_64_intdigest(content)
    st = os.stat(data / copied.name)
    assert st.st_mtime_ns == COPY_MTIME_NS and copied.copy_id == (st.st_ino, st.st_ctime_ns)
    assert os.listdir(data) == [copied.name]


@pytest.mark.parametrize("change", ["grown", "shrunk", "rewritten", "replaced"])
def test_a_file_that_is_not_the_expected_version_leaves_no_copy(dirs, change):
    backing, data, _, _ = dirs
    path = backing / "f"
    path.write_bytes(b"a" * 10000)
    fp = fingerprint(os.stat(path))
    if change == "grown":
        with open(path, "ab") as f:
            f.write(b"b")
    elif change == "shrunk":
        os.truncate(path, 5000)
    elif change == "rewritten":  # same size, same mtime put back: ctime still moves
        st = os.stat(path)
        with open(path, "r+b") as f:
            f.write(b"c")
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        (backing / "g").write_bytes(b"a" * 10000)
        os.replace(backing / "g", path)
    with pytest.raises(BackingChanged) as info:
        _copy(dirs, b"f", fp)
    assert info.value.st is not None and fingerprint(info.value.st) == fingerprint(os.stat(path))
    assert os.listdir(data) == []  # neither a copy nor a temp file


def test_holes_stay_holes_and_the_bytes_are_the_same(dirs):
    backing, data, _, _ = dirs
    path = backing / "sparse"
    with open(path, "wb") as f:
        f.seek(8 << 20)
        f.write(b"middle" * 1000)
        f.seek(32 << 20)
        f.write(b"end")
        f.truncate(40 << 20)  # a trailing hole too
    st = os.stat(path)
    if st.st_blocks * 512 >= st.st_size:
        pytest.skip("this filesystem does not keep holes")
    copied = _copy(dirs, b"sparse", fingerprint(st), hash_content=True)
    cst = os.stat(data / copied.name)
    assert cst.st_size == st.st_size
    assert cst.st_blocks <= st.st_blocks + 64  # holes stayed holes (a few blocks of rounding allowed)
    with open(path, "rb") as a, open(data / copied.name, "rb") as b:
        whole = a.read()
        assert whole == b.read()
    assert copied.digest == xxhash.xxh3_64_intdigest(whole)


def test_an_unreadable_or_missing_file_is_an_oserror_and_leaves_nothing(dirs):
    backing, data, root, dfd = dirs
    (backing / "d").mkdir()
    st = os.stat(backing / "d")
    with pytest.raises(OSError):  # a directory where a file was (EISDIR on the read, or changed)
        copy_into_cache(root, st.st_dev, b"d", (4096, st.st_mtime_ns, st.st_ino, st.st_ctime_ns), dfd, 1,
                        sparse=False, hash_content=False, throttle=None, block=4096)
    with pytest.raises(FileNotFoundError):
        copy_into_cache(root, st.st_dev, b"gone", (1, 0, 0, 0), dfd, 2, sparse=False, hash_content=False,
                        throttle=None, block=4096)
    assert not [n for n in os.listdir(data) if not n.startswith(TEMP_PREFIX)] and os.listdir(data) == []


STRACE_PROBE = r"""
import os, sys
from tierfs.daemon.cache.store import cache_block
from tierfs.daemon.staging.copier import copy_into_cache
from tierfs.daemon.tree.tree import fingerprint
backing, data = sys.argv[1], sys.argv[2]
root = os.open(backing, os.O_RDONLY | os.O_DIRECTORY)
dfd = os.open(data, os.O_RDONLY | os.O_DIRECTORY)
st = os.stat(os.path.join(backing, "f"))
os.write(2, b"=== copy starts\n")
copy_into_cache(root, st.st_dev, b"f", fingerprint(st), dfd, 7, sparse=False, hash_content=False,
                throttle=None, block=cache_block(data))
os.write(2, b"=== copy ends\n")
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_a_staged_file_costs_one_open_one_read_and_one_fstat(dirs, tmp_path):
    """On a network backing each call on the source descriptor is a round trip: a 110 KiB file is one open,
    one read (none at EOF) and one fstat after it, nothing more -- besides the fstat that checks the type of what
    was opened (a FIFO is never read; NFS and FUSE answer it from the attributes the open brought) and the fcntl
    that clears its O_NONBLOCK (local)."""
    backing, data, _, _ = dirs
    (backing / "f").write_bytes(os.urandom(110 << 10))
    log = tmp_path / "strace.log"
    subprocess.run(["strace", "-f", "-e", "trace=%file,%desc", "-o", str(log), sys.executable, "-c", STRACE_PROBE,
                    str(backing), str(data)], check=True, timeout=120, capture_output=True)
    lines = log.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "=== copy starts" in line)
    end = next(i for i, line in enumerate(lines) if "=== copy ends" in line)
    calls = lines[start + 1:end]
    opened = [line for line in calls if "openat2(" in line or ("openat(" in line and '"f"' in line)]
    assert len(opened) == 1, calls
    src_fd = opened[0].rsplit("=", 1)[1].strip()
    same = {"newfstatat": "fstat", "statx": "fstat", "read": "readv", "pread64": "readv"}
    on_src = [line.split("(", 1)[0].split()[-1] for line in calls
              if f"({src_fd}," in line or f"({src_fd})" in line]
    on_src = [same.get(name, name) for name in on_src]
    assert sorted(on_src) == ["close", "fcntl", "fstat", "fstat", "readv"], calls

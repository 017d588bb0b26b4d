"""The backing scan and opens beneath the root: no link followed, no filesystem crossed."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest

from tierfs import tree as tree_mod
from tierfs.tree import KIND_DIR, KIND_LINK, Tree, open_beneath


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    (r / "b" / "c").mkdir(parents=True)
    (r / "a.bin").write_bytes(b"a")
    (r / "b" / "z.bin").write_bytes(b"zz")
    (r / "b" / "c" / "y.bin").write_bytes(b"yyy")
    (r / "b" / "fifo").parent.mkdir(exist_ok=True)
    os.mkfifo(r / "b" / "fifo")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_bytes(b"secret")
    os.symlink(tmp_path / "outside", r / "link_dir")
    os.symlink("z.bin", r / "b" / "link_file")
    (r / ".tierfs").mkdir()
    (r / ".tierfs" / "shadowed.bin").write_bytes(b"s")  # hidden by the mount's control dir: not data
    return r


def test_scan_storage_order_kinds_and_links(root):
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        t = Tree.scan(fd)
    finally:
        os.close(fd)
    assert [t.file_path(i) for i in range(t.n_files)] == [b"a.bin", b"b/c/y.bin", b"b/z.bin"]
    assert t.sizes.tolist() == [1, 3, 2]
    kinds = {n.path: n.kind for n in t.nodes}
    assert kinds[b"link_dir"] == KIND_LINK and kinds[b"b/c"] == KIND_DIR
    assert b"b/fifo" not in kinds and b"link_dir/secret" not in kinds
    assert t.nodes[t.nodes[0].children[b"link_dir"]].link == os.fsencode(root.parent / "outside")
    assert t.dirs_with_data[t.nodes[0].children[b"b"]]


@pytest.mark.parametrize("use_openat2", [True, False])
def test_open_beneath_refuses_links_anywhere(root, monkeypatch, use_openat2):
    monkeypatch.setattr(tree_mod, "_have_openat2", use_openat2 and tree_mod._have_openat2)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    dev = os.fstat(fd).st_dev
    try:
        f = open_beneath(fd, b"b/c/y.bin", dev)
        assert os.read(f, 10) == b"yyy"
        os.close(f)
        for path in (b"link_dir/secret", b"b/link_file"):
            with pytest.raises(OSError) as exc:
                open_beneath(fd, path, dev)
            assert exc.value.errno in (errno.ELOOP, errno.ENOTDIR)
        with pytest.raises(OSError):
            open_beneath(fd, b"../outside/secret", dev)
    finally:
        os.close(fd)


def test_scan_and_open_never_cross_filesystems(root, tmp_path):
    inner = root / "b" / "mnt"
    inner.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(inner)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (inner / "other.bin").write_bytes(b"other fs")
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            t = Tree.scan(fd)
            assert all(not n.path.startswith(b"b/mnt") for n in t.nodes)
            for have in (True, False):
                tree_mod._have_openat2 = have and tree_mod._have_openat2
                with pytest.raises(OSError) as exc:
                    open_beneath(fd, b"b/mnt/other.bin", t.dev)
                assert exc.value.errno == errno.EXDEV
        finally:
            os.close(fd)
            tree_mod._have_openat2 = tree_mod._libc is not None
    finally:
        subprocess.run(["umount", "-l", str(inner)], capture_output=True)

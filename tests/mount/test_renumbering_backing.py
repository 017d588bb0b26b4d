"""A backing that numbers inodes per mount (sshfs without ``noforget``, rclone, gcsfuse, s3fs): issue 48 item 3.
A server that forgets or restarts gives every file a new inode number; tierfs knows a copy by the file's size and
times there (``stable_inodes=auto`` on a FUSE backing), so nothing is copied twice."""

from __future__ import annotations

import os

import pytest

from tierfs.testing.harness import make_dataset, mounted, passthrough, read_bytes, wait_until, within


def _status(m) -> dict:
    st = within(m.mountpoint, m.status)
    assert isinstance(st, dict), st
    return st


def _settled(m) -> bool:
    st = _status(m)
    return bool(st["next_ready"]) and st["staging"]["inflight"] == 0 and st["staging"]["queued"] == 0


@pytest.mark.parametrize("stable_inodes", ["auto", "yes"])
def test_a_backing_that_renumbers_its_inodes_is_read_once_per_copy(tmp_path, stable_inodes):
    """The passthrough backing hands out new inode numbers at its restart.  Under ``auto`` the copies made before
    stay (the same names in ``data/``), each copy made after reads its file once from the backing, and every file
    reads right; under ``yes`` (the inode number part of a copy's identity, as before this option) the copies
    made after the restart find their files changed and read them twice -- what ``auto`` is for."""
    data, inner, outer, served = tmp_path / "data", tmp_path / "inner", tmp_path / "outer", tmp_path / "served"
    files = make_dataset(data, dirs=4, files_per_dir=8, min_size=8 << 10, max_size=16 << 10, seed=11)
    inner.mkdir()
    outer.mkdir()
    cache = tmp_path / "c"
    with passthrough(data, inner, count=str(served), renumber=True) as pt, \
            mounted(inner, outer, cache, "256K", nm=4, rf=100000, backing_timeout=2,
                    stable_inodes=stable_inodes) as m:
        wait_until(lambda: _settled(m), what="two mini-epochs staged")
        assert _status(m)["tree"]["stable_inodes"] is (stable_inodes == "yes")
        copies = set(os.listdir(cache / "data"))
        inode = os.stat(inner / sorted(files)[0]).st_ino
        pt.kill()
        pt.unmount()
        os.unlink(served)  # (the new daemon counts from 0)
        pt.start()  # every inode number is new now
        assert os.stat(inner / sorted(files)[0]).st_ino != inode
        wait_until(lambda: _status(m)["backing"]["state"] == "ok", timeout=30, what="the backing taken back")
        read0, staged0 = pt.served(), _status(m)["staging"]["bytes_staged"]
        kept = copies & set(os.listdir(cache / "data"))  # (the next mini-epoch's copies)
        for i in range(2):  # two more mini-epochs staged, from the renumbered backing
            st = _status(m)
            at = (st["epoch"], st["mini_epoch"])
            within(str(outer), lambda: m.control("advance\n"))
            wait_until(lambda at=at: (_status(m)["epoch"], _status(m)["mini_epoch"]) != at and _settled(m),
                       timeout=60, what="the next mini-epoch staged")
            if i == 0 and stable_inodes == "auto":  # (the mini-epoch copied before the restart is served as it is)
                assert len(kept & set(os.listdir(cache / "data"))) >= _status(m)["view_files"] > 0
        read, staged = pt.served() - read0, _status(m)["staging"]["bytes_staged"] - staged0
        assert staged > 0
        if stable_inodes == "auto":
            assert read == staged, (read, staged)  # (each copy read its file once)
        else:
            assert read >= 1.5 * staged, (read, staged)  # (found changed after the copy: read again)
        for rel in sorted(files):
            assert within(str(outer), lambda rel=rel: read_bytes(m.path(rel))) == read_bytes(str(data / rel)), rel

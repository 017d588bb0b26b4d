"""A data set that grows under a mount (issue 48 item 6, second half): files added to the backing dir -- to a
class directory and as a new class directory -- join the mini-epochs at a later epoch, through the real
mount, without a remount: in ``order`` and the listings, read with their bytes, while every file already there
keeps its inode number."""

from __future__ import annotations

import os
import time

from tierfs.client import Client
from tierfs.testing.harness import make_dataset, mounted, read_bytes, wait_until, within

NEW = {"class_000/zz_new.bin": b"n" * 5000, "class_new/a.bin": b"a" * 3000, "class_new/b.bin": b"b" * 7}


def test_files_added_to_the_backing_join_a_later_epoch_of_the_same_mount(tmp_path):
    backing = tmp_path / "b"
    files = make_dataset(backing, dirs=3, files_per_dir=8, max_size=8 << 10, seed=9)
    (tmp_path / "m").mkdir()
    with mounted(backing, tmp_path / "m", tmp_path / "c", sum(files.values()) + (256 << 10), nm=2, rf=1,
                 listing="all") as m:
        inodes = {f: within(m.mountpoint, lambda f=f: os.stat(m.path(f)).st_ino) for f in files}
        for rel in ("class_new", "class_000/zz_new.bin"):  # (probed before they exist: the kernel keeps that)
            assert not within(m.mountpoint, lambda rel=rel: os.path.exists(m.path(rel)))
        for rel, data in NEW.items():
            (backing / rel).parent.mkdir(exist_ok=True)
            (backing / rel).write_bytes(data)
        seen: set[str] = set()
        hidden: list[dict] = []  # (status while the new files were taken, not joined)
        passes = m.status()["passes_total"]
        deadline = time.monotonic() + 60  # (a rescan takes a file changed 2 s before it started: ADD_SETTLE_S)
        while time.monotonic() < deadline:  # (passes, each read whole from its order, until every new file was in one)
            time.sleep(0.2)
            st = m.status()
            if st["tree"]["joining"]:
                hidden.append(st["tree"])
                assert not os.path.exists(m.path("class_new")) and "zz_new.bin" not in within(
                    m.mountpoint, lambda: os.listdir(m.path("class_000")))
            order = [p.decode() for p in within(m.mountpoint, lambda: Client(m.mountpoint).order())]
            for rel in order:
                got = within(m.mountpoint, lambda rel=rel: read_bytes(m.path(rel)))
                assert got == (NEW[rel] if rel in NEW else read_bytes(str(backing / rel))), rel
            seen |= set(order) & set(NEW)
            if seen == set(NEW):
                break
            wait_until(lambda: m.status()["passes_total"] > passes, what="the pass to end")  # noqa: B023
            passes = m.status()["passes_total"]
        assert seen == set(NEW), (seen, m.status()["tree"])
        assert hidden and hidden[0]["joining"] == len(NEW)
        # a listing shows them (listing=all: every file of the data set), the files there keep their inodes
        assert sorted(within(m.mountpoint, lambda: os.listdir(m.path("class_new")))) == ["a.bin", "b.bin"]
        assert "zz_new.bin" in within(m.mountpoint, lambda: os.listdir(m.path("class_000")))
        assert {f: within(m.mountpoint, lambda f=f: os.stat(m.path(f)).st_ino) for f in files} == inodes
        tree = m.status()["tree"]
        assert (tree["added"], tree["joining"], tree["left_out"]) == (len(NEW), 0, 0) and tree["rescans"] >= 1

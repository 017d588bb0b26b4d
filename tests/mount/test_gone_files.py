"""A backing that changes shape under a mount (issue 48 item 6): files and a whole class directory removed
mid-epoch leave the mini-epochs -- ENOENT, never EIO; not in listings or ``order``; passes go on ending by the
reads of the files that are left; staging does not retry them."""

from __future__ import annotations

import errno
import os
import shutil
import time

from tierfs.client import Client
from tierfs.testing.harness import make_dataset, mounted, read_bytes, wait_until, within


def test_files_and_a_directory_removed_mid_epoch_leave_the_mini_epochs(tmp_path):
    backing = tmp_path / "b"
    files = make_dataset(backing, dirs=4, files_per_dir=10, max_size=8 << 10, seed=5)
    (tmp_path / "m").mkdir()
    with mounted(backing, tmp_path / "m", tmp_path / "c", sum(files.values()) // 2 + (256 << 10), nm=4, rf=1,
                 revalidate=1) as m:
        wait_until(lambda: m.status()["next_ready"], what="the next mini-epoch staged")
        first = [p.decode() for p in within(m.mountpoint, lambda: Client(m.mountpoint).order())]  # (a loader's)
        removed = {f for f in files if f.endswith("3.bin")}
        for f in removed:
            os.unlink(backing / f)
        shutil.rmtree(backing / "class_002")
        removed |= {f for f in files if f.startswith("class_002/")}
        time.sleep(1.5)  # (past revalidate: the copies are asked about at their opens, or the re-stats find them)
        errors: dict[str, int] = {}
        met: set[str] = set()  # (removed files an open answered for: ENOENT)
        passes = m.status()["passes_total"]
        for i in range(8):  # two epochs of passes, each read whole from its order (the first read before)
            order = first if i == 0 else [p.decode() for p in within(m.mountpoint,
                                                                      lambda: Client(m.mountpoint).order())]
            for rel in order:
                got = within(m.mountpoint, lambda rel=rel: read_bytes(m.path(rel)))
                if isinstance(got, OSError):
                    errors[errno.errorcode[got.errno]] = errors.get(errno.errorcode[got.errno], 0) + 1
                    assert rel in removed, (rel, got)
                    met.add(rel)
                elif rel not in removed:  # (a removed file's copy may serve it within revalidate)
                    assert got == read_bytes(str(backing / rel)), rel
            wait_until(lambda: m.status()["passes_total"] > passes, what="the pass to end")  # noqa: B023
            passes = m.status()["passes_total"]
        assert met & set(first) and set(errors) == {"ENOENT"}, errors  # (never EIO: 25,936 before, a directory)
        st = m.status()
        assert len(met) <= st["tree"]["gone"] <= len(removed) and st["epoch"] >= 1, st["tree"]
        # a removed file found gone is in no order and no listing any more
        order = {p.decode() for p in within(m.mountpoint, lambda: Client(m.mountpoint).order())}
        assert not order & met
        listed = {f"{d}/{n}" for d in within(m.mountpoint, lambda: os.listdir(m.mountpoint))
                  for n in within(m.mountpoint, lambda d=d: os.listdir(m.path(d)))}
        assert not listed & met
        wait_until(lambda: m.status()["next_ready"], what="staging settled")
        skipped = m.status()["staging"]["skipped"]
        time.sleep(6)  # (past the stager's retry time: a gone file is never tried again)
        assert m.status()["staging"]["skipped"] == skipped

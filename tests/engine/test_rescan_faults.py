"""A rescan over a tier that fails for a moment (issue 51): the sshfs slow tier of the cluster tests listed the
backing dir empty on four nodes at once, under load; the rescan took every file for gone, saved that tree, and
the next job's mounts failed ("nm=4 is more mini-epochs than the data set has files: use at most 0").  A listing
with no file where the tree had some is a fault of the tier: the mount keeps its files (one really gone is found
at its next open), and the tree saved for the next mount is not replaced."""

from __future__ import annotations

import functools
import logging
import os
import shutil

import trio

from tierfs.daemon.tree import keeper as keeper_mod
from tierfs.daemon.tree.keeper import TREE_NAME, TreeKeeper


class _Events:
    """What the keeper tells the engine (``RescanEvents``), recorded; the epoch moves when the test says."""

    def __init__(self) -> None:
        self.epoch = 0
        self.gone_files: list[int] = []
        self.changed_files: list[int] = []
        self.confirmed = 0

    def all_confirmed(self) -> None:
        self.confirmed += 1

    def changed(self, fidx: int, st: os.stat_result) -> None:
        self.changed_files.append(fidx)

    def gone(self, fidx: int) -> None:
        self.gone_files.append(fidx)

    def running_epoch(self) -> int:
        return self.epoch

    def grew(self, growth: object) -> None:
        raise AssertionError("nothing was added")


def test_a_rescan_that_lists_no_file_keeps_the_data_set(tmp_path, monkeypatch, caplog):
    backing, cache = tmp_path / "backing", tmp_path / "cache"
    for c in range(3):
        (backing / f"class_{c}").mkdir(parents=True)
        for i in range(4):
            (backing / f"class_{c}" / f"{i}.bin").write_bytes(b"x" * (100 + i))
    cache.mkdir()
    root_fd = os.open(backing, os.O_RDONLY | os.O_DIRECTORY)
    cache_fd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY)
    monkeypatch.setattr(keeper_mod, "RESCAN_POLL_S", 0.05)
    try:
        keeper = TreeKeeper(root_fd, str(backing), cache_fd)
        tree = keeper.load(resumed=False)
        assert tree.n_files == 12
        events = _Events()

        async def main() -> None:
            limiter = trio.CapacityLimiter(1)
            await keeper.run(tree, limiter=limiter, events=events)  # (saves the scan)
            saved = os.stat(TREE_NAME, dir_fd=cache_fd).st_mtime_ns
            away = tmp_path / "away"  # (the tier lists the dir empty: here, its entries moved away)
            away.mkdir()
            for entry in os.listdir(backing):
                os.rename(backing / entry, away / entry)
            async with trio.open_nursery() as n:
                n.start_soon(functools.partial(keeper.follow, tree, limiter=limiter, events=events))
                await trio.sleep(0.2)  # (it notes the epoch it starts in)
                events.epoch = 1
                with trio.fail_after(30):
                    while keeper.stats.rescan != "done" or "lists no file" not in caplog.text:
                        await trio.sleep(0.02)
                # one file back: the next rescan takes the others for gone, as a real deletion is
                shutil.move(away / "class_0", backing / "class_0")
                events.epoch = 2
                with trio.fail_after(30):
                    while len(events.gone_files) < 8:
                        await trio.sleep(0.02)
                n.cancel_scope.cancel()
            assert os.stat(TREE_NAME, dir_fd=cache_fd).st_mtime_ns != saved  # (the second saved its news)

        with caplog.at_level(logging.WARNING, logger="tierfs"):
            trio.run(main)
        assert "rescan: the backing dir lists no file where 12 were: taken for a fault of the tier" in caplog.text
        gone = sorted(tree.file_path(f).split(b"/")[0] for f in events.gone_files)
        assert gone == [b"class_1"] * 4 + [b"class_2"] * 4
    finally:
        os.close(root_fd)
        os.close(cache_fd)

"""Mini-epochs as a user sees them with a 64 MiB file among 3,000 small ones (issue 14's report)."""

from __future__ import annotations

import os

import pytest

from tierfs.testing.harness import mounted, within


def test_a_large_file_among_small_ones_gives_nm_balanced_mini_epochs_numbered_in_order(tmp_path, wait_position):
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    for d in range(10):
        (backing / f"class_{d}").mkdir(parents=True)
        for i in range(300):
            (backing / f"class_{d}" / f"{i:04d}.bin").write_bytes(b"x" * (1024 + 7 * i))
    with open(backing / "class_3" / "big.bin", "wb") as f:
        f.truncate(64 << 20)  # sparse: sized 64 MiB, cheap to make and to stage
    mnt.mkdir()
    nm, n = 8, 3001
    with mounted(backing, mnt, tmp_path / "cache", "160M", nm=nm, rf=1, seed=5) as m:
        seen = []
        for me in range(nm):
            st = wait_position(m, (0, me))  # every index 0..nm-1 in turn, none skipped
            assert len(st["rf_effective"]) == me + 1  # one entry per mini-epoch, in order
            with open(os.path.join(mnt, ".tierfs", "order0"), "rb") as f:
                view = f.read().split(b"\0")[:-1]
            assert len(view) == st["view_files"]
            # no near-empty mini-epoch: each holds about n / nm files, the big one's too
            assert len(view) >= 0.8 * n / nm, (me, len(view))
            seen += view
            m.control("advance\n")
        assert len(seen) == len(set(seen)) == n  # the epoch: every file once
        st = wait_position(m, (1, 0))  # then the next epoch starts at mini-epoch 0
        assert len(st["rf_effective"]) == nm + 1


def _read_through_epochs(m, backing, epochs: int, deadline_s: float) -> dict[int, dict[int, set[str]]]:
    """Read every file of each pass through the mount (bytes checked against the backing) until the mount is in
    epoch ``epochs``; the files of each (epoch, mini-epoch).  In a thread with a deadline: a hang aborts the
    FUSE connection (the readers let go) and fails."""
    views: dict[int, dict[int, set[str]]] = {}
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while (st := m.status())["epoch"] < epochs:
                listed = {f"{d}/{n}" for d in os.listdir(m.mountpoint) for n in os.listdir(m.path(d))}
                after = m.status()
                if (after["epoch"], after["mini_epoch"]) != (st["epoch"], st["mini_epoch"]):
                    continue  # (listed across a switch: list again)
                seen = views.setdefault(st["epoch"], {}).setdefault(st["mini_epoch"], listed)
                assert seen == listed  # a repeated pass shows the same files
                for rel in sorted(listed):
                    with open(m.path(rel), "rb") as f, open(os.path.join(backing, rel), "rb") as b:
                        assert f.read() == b.read(), rel
        except BaseException as exc:
            errors.append(exc)

    within(m.mountpoint, reader, deadline_s)  # (a hang aborts the connection and fails the test)
    if errors:
        raise errors[0]
    return views


@pytest.mark.parametrize("advance", ["strict", "ready"])
def test_reads_through_epoch_boundaries_with_plans_made_ahead(tierfs_mount, dataset, advance):
    # (issue 22) the next epoch is planned in a worker thread from the start of an epoch; a reader going
    # through three epochs reads right bytes, every file once per epoch, every mini-epoch in order
    backing, files = dataset
    nm = 4
    with tierfs_mount(capacity=sum(files.values()) // 2, nm=nm, rf=1, advance=advance) as m:
        views = _read_through_epochs(m, backing, epochs=3, deadline_s=180)
        st = m.status()
        assert st["last_error"] is None and st["epoch"] == 3
        assert len(st["rf_effective"]) == 3 * nm + 1
    for epoch in range(3):
        assert sorted(views[epoch]) == list(range(nm)), views[epoch].keys()
        parts = list(views[epoch].values())
        assert sum(map(len, parts)) == len(set().union(*parts)) == len(files)  # each file once per epoch
    assert views[0] != views[1]  # a new plan per epoch

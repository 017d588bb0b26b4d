"""Mini-epochs as a user sees them with a 64 MiB file among 3,000 small ones (issue 14's report)."""

from __future__ import annotations

import os

from tierfs.testing import mounted


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

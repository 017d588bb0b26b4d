"""Node-level sharding on one machine: two mounts, rank 0 and 1 of world_size 2, over one backing dir."""

from __future__ import annotations

from tierfs.testing.harness import mounted


def test_two_ranks_cover_every_mini_epoch_disjointly_and_completely(dataset, tmp_path, wait_position):
    backing, files = dataset  # 32 files in 4 class dirs
    nm = 4
    (tmp_path / "mnt0").mkdir()
    (tmp_path / "mnt1").mkdir()
    with (
        mounted(backing, tmp_path / "mnt0", tmp_path / "cache0", "1M", nm=nm, seed=7, rank=0, world_size=2) as m0,
        mounted(backing, tmp_path / "mnt1", tmp_path / "cache1", "1M", nm=nm, seed=7, rank=1, world_size=2) as m1,
    ):
        seen: list[str] = []
        for epoch in range(2):
            epoch_files: list[str] = []
            for me in range(nm):
                shares = []
                for m in (m0, m1):
                    st = wait_position(m, (epoch, me))
                    with open(m.path(".tierfs", "order0"), "rb") as f:
                        share = [p.decode() for p in f.read().split(b"\0")[:-1]]
                    assert len(share) == st["view_files"] >= 1  # no empty share: numbering 0..nm-1
                    shares.append(share)
                assert not set(shares[0]) & set(shares[1])  # the ranks' shares are disjoint
                epoch_files += shares[0] + shares[1]
                for m in (m0, m1):
                    m.control("advance\n")
            assert sorted(epoch_files) == sorted(files)  # together: every file exactly once per epoch
            seen.append(",".join(epoch_files))
        assert seen[0] != seen[1]  # a new plan each epoch, the same on both nodes

"""``MountSampler`` off a mount (a plain directory: a laptop copy of the data) shuffles as ``DistributedSampler``
does -- the one line replaces ``shuffle=True``, so the same script must not train class-sorted there."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DistributedSampler  # noqa: E402

from tierfs.torch import MountSampler  # noqa: E402


class Paths:
    """A map-style dataset of paths (what ``MountSampler`` maps by), class-sorted as ImageFolder holds them."""

    def __init__(self, root: str) -> None:
        self.paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)

    def __len__(self) -> int:
        return len(self.paths)


def test_off_a_mount_the_sampler_shuffles_each_epoch_as_distributed_sampler_does(tmp_path):
    for c in range(3):
        (tmp_path / f"class{c}").mkdir()
        for i in range(7):
            (tmp_path / f"class{c}" / f"{i}.bin").write_bytes(b"x")
    ds = Paths(str(tmp_path))
    for world_size in (1, 2):
        for rank in range(world_size):
            ours = MountSampler(ds, rank=rank, world_size=world_size)
            theirs = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
            assert ours.indices.client is None and len(ours) == len(theirs)
            epochs = []
            for epoch in range(3):
                ours.set_epoch(epoch)
                theirs.set_epoch(epoch)
                epochs.append(list(ours))
                assert epochs[-1] == list(theirs) == list(ours)  # (an epoch's order is its seed's)
            assert len({tuple(e) for e in epochs}) == 3  # a new order every epoch
    whole = list(MountSampler(ds))
    assert sorted(whole) == list(range(len(ds))) and whole != sorted(whole)  # every index, not class-sorted
    assert list(MountSampler(ds, shuffle=False)) == list(range(len(ds)))

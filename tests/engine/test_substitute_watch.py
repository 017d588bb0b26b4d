"""Under substitute the loader watch knows what a pass costs: no ``stuck`` warning for a loader that reads its
names as a dataset built once does (issue 23: the convergence runs under substitute got 1-6 false warnings)."""

from __future__ import annotations

import os
import random

import pyfuse3
import pytest

from tierfs.daemon.fuse.operations import TierOperations
from tierfs.testing.harness import make_dataset

CTX = pyfuse3.RequestContext()  # (root: steers the schedule)


@pytest.fixture
def dataset(tmp_path):
    """40 class dirs x 4 files: a view of a quarter (stratified) holds one file per dir, so a pass under
    substitute ends when every dir was read once -- about 40 x H(40) = 171 opens of a shuffled loader, more than
    three times the view's 40 files."""
    backing = tmp_path / "backing"
    return backing, make_dataset(backing, dirs=40, files_per_dir=4, max_size=512, seed=5)


def test_a_shuffled_loader_of_every_name_is_not_stuck(open_engine, dataset, t):
    _, files = dataset
    e = open_engine(substitute=True, listing="all", nm=4, rf=2, composition="stratified", advance="strict")
    ops = TierOperations(e)
    names = sorted(files)
    rng = random.Random(1)

    async def read(rel: str) -> None:
        d, name = rel.split("/")
        parent = await ops.lookup(pyfuse3.ROOT_INODE, d.encode(), CTX)
        a = await ops.lookup(parent.st_ino, name.encode(), CTX)
        fi = await ops.open(a.st_ino, os.O_RDONLY, CTX)
        try:
            await ops.read(fi.fh, 0, 1 << 20)
        finally:
            await ops.release(fi.fh)

    async def main():
        for _ in range(6):  # six epochs of the dataset built once, each in a fresh shuffle
            for rel in rng.sample(names, len(names)):
                await read(rel)
        st = e.status()
        assert st.passes_total >= 3 and e.data.out_of_view == 0
        assert st.loader.warnings == 0, st.loader.warning

    t.run(main)

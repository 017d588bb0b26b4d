"""Shard loaders over real mounts: WebDataset tar shards and Parquet files, with the shard list that follows the
view (``tierfs.torch.MountShards``): every shard of a pass read once per pass across two ranks and their
DataLoader workers, none outside the view, the mini-epochs advancing, the bytes and rows the backing's."""

from __future__ import annotations

import gc
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tierfs.client import Client
from tierfs.testing.harness import make_parquet_files, make_tar_shards, mounted

pytest.importorskip("torch")

_DEADLINE = 120  # seconds for one epoch's reads (a hung mount fails the test; mounted() aborts it after)
_EPOCHS, _NM, _RF = 8, 3, 2


def _collate(batch):
    return batch


def _items(loader) -> list:
    """Every item of a DataLoader epoch (batches of lists, see _collate)."""
    return [x for batch in loader for x in batch]


def _check_mount_after(m, st0: dict, positions: list[tuple[int, int]], total: int) -> None:
    """Every epoch was one pass, every open in view, the mini-epochs advanced, the slow tier read about data/rf."""
    st = m.status()
    assert st["passes_total"] - st0["passes_total"] == _EPOCHS
    assert st["reads"]["out_of_view"] == 0 and st["loader"]["follows_view"]
    # (advance=strict: rf passes to a mini-epoch)
    assert positions == [(e // (_NM * _RF), e % (_NM * _RF) // _RF) for e in range(_EPOCHS)]
    biggest = max(st["view_bytes"], st["prefetch"]["bytes_total"])
    assert st["backing_bytes_read"] <= total * _EPOCHS / (_NM * _RF) + 2 * biggest


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # (4 workers on a 2-core test machine)
def test_webdataset_with_mount_shards_reads_each_pass_s_shards_once_across_ranks_and_workers(mount_dirs):
    """Two ranks, each a webdataset pipeline in a DataLoader with 2 workers (rank 0's persistent, rank 1's
    started again every epoch): every shard of each pass read once, each rank every other shard of the pass
    (webdataset's split_by_node), the samples the backing's."""
    import webdataset as wds
    from torch.utils.data import DataLoader

    from tierfs.torch import MountShards

    mnt, cache = mount_dirs
    backing = Path(mnt).parent / "shards"
    made = make_tar_shards(backing, 12, seed=3)
    total = sum(f.stat().st_size for f in backing.iterdir())
    with mounted(backing, mnt, cache, total, nm=_NM, rf=_RF, advance="strict") as m:
        pattern = os.path.join(m.mountpoint, "shard-{000000..000011}.tar")  # the brace URL a user writes
        shards = [MountShards(pattern, rank=r, world_size=2) for r in range(2)]
        loaders = [DataLoader(wds.DataPipeline(s, wds.tarfile_to_samples()), batch_size=3, num_workers=2,
                              persistent_workers=r == 0, collate_fn=_collate) for r, s in enumerate(shards)]
        client = Client(m.mountpoint)
        st0 = m.status()
        positions = []
        with ThreadPoolExecutor(2) as pool:
            for epoch in range(_EPOCHS):
                for s in shards:
                    s.set_epoch(epoch)
                st = m.status()
                positions.append((st["epoch"], st["mini_epoch"]))
                order = [p.decode() for p in client.order()]
                assert 1 <= len(order) < len(made)
                # (each epoch's iterators made here, so that the workers are forked by this thread alone)
                its = [iter(dl) for dl in loaders]
                runs = [pool.submit(_items, it) for it in its]
                got = [r.result(timeout=_DEADLINE) for r in runs]
                for rank, samples in enumerate(got):
                    reads: Counter[str] = Counter()
                    for x in samples:
                        shard = os.path.relpath(x["__url__"], m.mountpoint)
                        members = made[shard]
                        assert x["cls"] == members[x["__key__"] + ".cls"]
                        assert x["bin"] == members[x["__key__"] + ".bin"]
                        reads[shard] += 1
                    # this rank's share, each shard whole (each of its samples once per time it is listed)
                    want = Counter(order[rank::2])
                    assert reads == {s: n * (len(made[s]) // 2) for s, n in want.items()}
                assert m.status()["passes_total"] == st["passes_total"] + 1  # the pass ended with its reads
            _check_mount_after(m, st0, positions, total)
            # an epoch started without set_epoch: a worker would read the last pass again, and says so
            with pytest.raises(RuntimeError, match="set_epoch"):
                pool.submit(_items, loaders[0]).result(timeout=_DEADLINE)
        del loaders, its, runs  # (the persistent workers stop now, while the mount serves)
        gc.collect()


def test_pyarrow_over_mount_shards_reads_each_pass_s_rows_once(mount_dirs):
    """Parquet files read with pyarrow: rank 0 in a DataLoader with 2 persistent workers (``ParquetFile`` per
    shard), rank 1 in its own process as a ``pyarrow.dataset`` over its shards of the pass: every row of each
    pass's files read once, the rows the backing's."""
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq
    from torch.utils.data import DataLoader, IterableDataset

    from tierfs.torch import MountShards

    class Rows(IterableDataset):
        def __init__(self, shards: MountShards) -> None:
            self.shards = shards

        def __iter__(self):
            for path in self.shards.files():
                with pq.ParquetFile(path) as f:
                    for batch in f.iter_batches(batch_size=16):
                        yield from zip(batch["id"].to_pylist(), batch["label"].to_pylist(),
                                       batch["payload"].to_pylist(), strict=True)

    mnt, cache = mount_dirs
    backing = Path(mnt).parent / "table"
    made = make_parquet_files(backing, 12, seed=4)
    total = sum(f.stat().st_size for f in backing.iterdir())
    with mounted(backing, mnt, cache, total, nm=_NM, rf=_RF, advance="strict") as m:
        paths = sorted(os.path.join(m.mountpoint, n) for n in made)  # (names known: no listing needed)
        shards = [MountShards(paths, rank=r, world_size=2) for r in range(2)]
        loader = DataLoader(Rows(shards[0]), batch_size=8, num_workers=2, persistent_workers=True,
                            collate_fn=_collate)

        def rank1() -> list[tuple[int, int, bytes]]:
            table = pads.dataset(list(shards[1].files()), format="parquet").to_table()  # draws the pass itself
            return list(zip(*(table[c].to_pylist() for c in ("id", "label", "payload")), strict=True))

        client = Client(m.mountpoint)
        st0 = m.status()
        positions = []
        with ThreadPoolExecutor(2) as pool:
            for epoch in range(_EPOCHS):
                shards[0].set_epoch(epoch)  # (rank 1, iterated in its main process, needs none)
                st = m.status()
                positions.append((st["epoch"], st["mini_epoch"]))
                order = [p.decode() for p in client.order()]
                it = iter(loader)
                runs = [pool.submit(_items, it), pool.submit(rank1)]
                got = [r.result(timeout=_DEADLINE) for r in runs]
                for rank, rows in enumerate(got):
                    want = Counter(row for name in order[rank::2] for row in made[name])
                    assert Counter(rows) == want
                assert m.status()["passes_total"] == st["passes_total"] + 1
        del loader, it, runs
        gc.collect()
        _check_mount_after(m, st0, positions, total)

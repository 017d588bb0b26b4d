"""Recipe: a Parquet data set read with pyarrow, following the mini-epochs with ``MountShards``.

    tierfs mount /data/table /mnt/table --cache /nvme/tierfs --capacity 100G --nm 8 --rf 4 --listing all --daemon
    python examples/parquet_loader.py /mnt/table --passes 8 --workers 4

The file list is made once (a glob over a ``listing=all`` mount finds every file; a list of known names needs no
listing).  ``tierfs.torch.MountShards(files).files()`` yields, in each ``DataLoader`` worker, its share of the
current pass's files, drawn by ``set_epoch`` before each epoch; each file is read with
``pyarrow.parquet.ParquetFile``, one row group batch at a time.  Without a ``DataLoader`` (or with
``num_workers=0``), iterate ``files()`` in the main process: each iteration is the next pass, e.g.
``pyarrow.dataset.dataset(list(shards.files()), format="parquet")``.  Prints one JSON line per pass: tierfs's
position and every row's file, id, label and the CRC-32 of its payload.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import zlib
from collections.abc import Iterator

import pyarrow.parquet as pq
from torch.utils.data import DataLoader, IterableDataset

from passes import tierfs_position
from tierfs.torch import MountShards


class ParquetRows(IterableDataset):
    """The rows of this worker's share of the pass's files: (file, id, label, payload)."""

    def __init__(self, shards: MountShards) -> None:
        self.shards = shards

    def __iter__(self) -> Iterator[tuple[str, int, int, bytes]]:
        for path in self.shards.files():
            with pq.ParquetFile(path) as f:
                for batch in f.iter_batches(batch_size=1024, columns=["id", "label", "payload"]):
                    for row in zip(*(batch[c].to_pylist() for c in ("id", "label", "payload")), strict=True):
                        yield (path, *row)


def collate(batch: list[tuple[str, int, int, bytes]]) -> list[tuple[str, int, int, bytes]]:
    return batch


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="a tierfs mount (listing=all) holding *.parquet")
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    args = ap.parse_args()
    shards = MountShards(sorted(glob.glob(os.path.join(args.root, "*.parquet"))))  # rank=, world_size=
    loader = DataLoader(ParquetRows(shards), batch_size=args.batch, num_workers=args.workers,
                        persistent_workers=args.workers > 0, collate_fn=collate)
    for p in range(args.passes):
        shards.set_epoch(p)
        line = {"pass_index": p, **tierfs_position(args.root), "samples": []}
        for batch in loader:
            for path, row_id, label, payload in batch:  # your training step
                line["samples"].append([os.path.relpath(path, args.root), row_id, label, zlib.crc32(payload)])
        print(json.dumps(line), flush=True)
    sys.exit(0)

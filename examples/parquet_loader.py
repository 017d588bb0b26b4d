"""Recipe: any Parquet data set read with pyarrow, following the mini-epochs with ``MountShards``.

    tierfs mount /data/table /mnt/table --cache /nvme/tierfs --capacity 100G --nm 8 --rf 4 --listing all --daemon
    python examples/parquet_loader.py /mnt/table --passes 8 --workers 4 [--columns image,label]

The file list is made once (a glob over a ``listing=all`` mount finds every file; a list of known names needs no
listing).  ``tierfs.torch.MountShards(files).files()`` yields, in each ``DataLoader`` worker, its share of the
current pass's files, drawn by ``set_epoch`` before each epoch; each file is read with
``pyarrow.parquet.ParquetFile``, one record batch at a time.  Each row is a dict of its columns: every column
each file has (``--columns A,B`` reads those alone, and names a file that lacks one).  Turn a row into tensors
where ``collate`` is (here the rows are passed through).  Without a ``DataLoader`` (or with ``num_workers=0``),
iterate ``files()`` in the main process: each iteration is the next pass, e.g.
``pyarrow.dataset.dataset(list(shards.files()), format="parquet")``.

Shows a progress line per pass; ``--json`` prints one JSON line per pass too: tierfs's position and every row's
file, row number in its file and the CRC-32 of ``repr`` of its values (in column order).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow.parquet as pq
from torch.utils.data import DataLoader, IterableDataset

from passes import PassReport, add_output_args, pass_progress, tierfs_position
from tierfs.torch import MountShards

Row = tuple[str, int, dict[str, Any]]  # (file, row number in the file, {column: value})


class ParquetRows(IterableDataset):
    """The rows of this worker's share of the pass's files, each ``(file, row number, {column: value})``:
    ``columns`` of each file, or all it has (None)."""

    def __init__(self, shards: MountShards, columns: Sequence[str] | None = None, batch_rows: int = 1024) -> None:
        self.shards = shards
        self.columns = list(columns) if columns else None
        self.batch_rows = batch_rows

    def __iter__(self) -> Iterator[Row]:
        for path in self.shards.files():
            with pq.ParquetFile(path) as f:
                has = f.schema_arrow.names
                missing = [c for c in self.columns or () if c not in has]
                if missing:
                    raise ValueError(f"{path}: no column {', '.join(map(repr, missing))} (it has {', '.join(has)}); "
                                     "give --columns that every file has, or none to read each file's own")
                row = 0
                for batch in f.iter_batches(batch_size=self.batch_rows, columns=self.columns):
                    names = batch.schema.names
                    for values in zip(*(batch.column(i).to_pylist() for i in range(len(names))), strict=True):
                        yield path, row, dict(zip(names, values, strict=True))
                        row += 1


def collate(batch: list[Row]) -> list[Row]:
    return batch  # (a real loader would decode and stack its columns here)


def row_crc(values: dict[str, Any]) -> int:
    """What the JSON line shows of a row: the CRC-32 of ``repr`` of its values, in column order."""
    return zlib.crc32(repr(tuple(values.values())).encode())


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="a tierfs mount (listing=all) holding *.parquet")
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    ap.add_argument("--columns", type=lambda text: [c for c in text.split(",") if c], default=None,
                    metavar="A,B,...", help="the columns to read (default: every column of each file)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    files = sorted(glob.glob(os.path.join(args.root, "**", "*.parquet"), recursive=True))
    if not files:
        ap.error(f"no *.parquet under {args.root} (on a tierfs mount, mount with --listing all)")
    shards = MountShards(files)  # rank=, world_size= for several processes on one mount
    loader = DataLoader(ParquetRows(shards, args.columns), batch_size=args.batch, num_workers=args.workers,
                        persistent_workers=args.workers > 0, collate_fn=collate)
    progress = pass_progress(args, args.root)
    for p in range(args.passes):
        shards.set_epoch(p)
        report = PassReport(p, tierfs_position(args.root), progress, passes=args.passes, json_lines=args.json)
        for batch in loader:  # your training step
            report.add_samples([[os.path.relpath(path, args.root), row, row_crc(values)]
                                for path, row, values in batch])
        report.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

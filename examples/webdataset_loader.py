"""Recipe: WebDataset tar shards named once with a brace URL, following the mini-epochs with ``MountShards``.

    tierfs mount /data/shards /mnt/shards --cache /nvme/tierfs --capacity 100G --nm 8 --rf 4 --daemon
    python examples/webdataset_loader.py '/mnt/shards/shard-{000000..000099}.tar' --passes 8 --workers 4

``tierfs.torch.MountShards`` goes where the brace URL went: the first stage of a ``wds.DataPipeline`` (not
``wds.WebDataset(urls)``, which copies its list once).  ``set_epoch`` before each epoch draws the current pass's
shards, in serving order, for every worker (``persistent_workers=True`` works); the shard list splits them
between ranks (``rank=``, ``world_size=``) and workers itself, so the pipeline has no ``split_by_node`` or
``split_by_worker``.  One ``DataLoader`` epoch is one tierfs pass.  Shows a progress line per pass; ``--json``
prints one JSON line per pass too: tierfs's position and every sample's shard, key, and the CRC-32 of its ``.bin``
member.
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib

import webdataset as wds
from torch.utils.data import DataLoader

from passes import PassReport, add_output_args, pass_progress, tierfs_position
from tierfs.torch import MountShards


def collate(batch: list[tuple[str, str, bytes]]) -> list[tuple[str, str, bytes]]:
    return batch  # (a real loader would decode and stack)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("urls", help="every shard, as a brace pattern under the mount")
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    add_output_args(ap)
    args = ap.parse_args()
    root = os.path.dirname(args.urls)
    shards = MountShards(args.urls)  # rank=, world_size= for several processes on one mount
    dataset = wds.DataPipeline(shards, wds.tarfile_to_samples(), wds.shuffle(100),
                               wds.to_tuple("__url__", "__key__", "bin"))
    loader = DataLoader(dataset, batch_size=args.batch, num_workers=args.workers,
                        persistent_workers=args.workers > 0, collate_fn=collate)
    progress = pass_progress(args, root)
    for p in range(args.passes):
        shards.set_epoch(p)
        report = PassReport(p, tierfs_position(root), progress, passes=args.passes, json_lines=args.json)
        for batch in loader:  # your training step
            report.add_samples([[os.path.relpath(url, root), key, zlib.crc32(data)] for url, key, data in batch])
        report.print()
    sys.exit(0)

"""Recipe: mini-epoch training with no filesystem at all: ``sampler.loader.MiniEpochSampler`` as a Sampler.

    python examples/sampler_without_fuse.py /data/imagenet --epochs 2 --nm 8 --rf 4

The same plans a tierfs mount makes (same seed, same ``plan_epoch``), applied to a plain directory by the
sampler of a DataLoader: each epoch is cut into ``nm`` byte-balanced mini-epochs, each served ``rf`` times in a
fresh order.  Useful when the data already sits on fast storage, or to compare against the mount.  Shows a
progress line per mini-epoch pass (``--json``: a JSON line too).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from torch.utils.data import DataLoader

from folder_dataset import FolderDataset, collate
from passes import PassReport, add_output_args, pass_progress
from sampler.loader import MiniEpochSampler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="a class-folder dataset on any filesystem")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--nm", type=int, default=4)
    ap.add_argument("--rf", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    add_output_args(ap)
    args = ap.parse_args(argv)
    progress = pass_progress(args, args.root)  # (a plain directory: samples/s alone)
    dataset = FolderDataset(args.root)  # a plain dir: listed once
    sizes = np.array([os.path.getsize(path) for path, _ in dataset.samples], dtype=np.int64)
    sampler = MiniEpochSampler(sizes, nm=args.nm, rf=args.rf, seed=args.seed)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        # one pass of one mini-epoch = len(that mini-epoch) indices; the sampler yields them back to back
        passes = [len(me) for me in sampler.plan for _ in range(args.rf)]
        batches = iter(DataLoader(dataset, batch_size=1, sampler=sampler, num_workers=args.workers,
                                  collate_fn=collate))
        for j, n in enumerate(passes):
            report = PassReport(epoch * len(passes) + j, {"epoch": epoch, "mini_epoch": j // args.rf,
                                                          "pass": j % args.rf},
                                progress, passes=args.epochs * len(passes), total=n, json_lines=args.json)
            for _ in range(n):
                report.add(next(batches))  # your training step
            report.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

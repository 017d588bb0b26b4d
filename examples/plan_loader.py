"""Recipe: ``tierfs.torch.MiniEpochDataset`` -- one batch plan per pass, the cached copies read directly.

    python examples/plan_loader.py /mnt/imagenet --passes 8 --workers 8

``set_epoch`` reads the pass's batch plan (``/.tierfs/plan``) once; the workers then read each cached file's
copy from the fast tier with no FUSE request (checked against the plan with ``fstat``; anything else through
the mount) and report what they read, so tierfs counts the pass exactly as it counts ``open()``s
(``reads.plan`` in ``tierfs status``).  Needs the mount's user or root; on a plain directory it reads the
files.  Keep ``shuffle=False`` (the plan is this pass's fresh serving order) and ``persistent_workers=False``.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.utils.data import DataLoader

from passes import PassReport, parse_args, pass_progress
from tierfs.torch import MiniEpochDataset

if __name__ == "__main__":
    args = parse_args(__doc__, None)
    progress = pass_progress(args, args.root)
    with MiniEpochDataset(args.root) as ds:
        for p in range(args.passes):
            ds.set_epoch(p)
            pos = ds.files.position
            report = PassReport(p, dict(zip(("epoch", "mini_epoch", "pass"), pos, strict=True)) if pos else {},
                                progress, passes=args.passes, total=len(ds), json_lines=args.json)
            first = 0
            for data, labels in DataLoader(ds, batch_size=args.batch, shuffle=False, num_workers=args.workers,
                                           collate_fn=lambda b: ([d for d, _ in b], [y for _, y in b])):
                paths = [os.path.relpath(s.path, args.root) for s in ds.files.samples[first:first + len(data)]]
                first += len(data)
                report.add({"path": paths, "label": torch.tensor(labels), "data": data})  # your training step
            report.print()
    sys.exit(0)

"""Recipe: the common way -- a dataset built once, before the epoch loop, and the one-line ``MountSampler``.

    tierfs mount /data/imagenet /mnt/imagenet ... --listing all
    python examples/built_once_loader.py /mnt/imagenet --passes 8 --batch 64 --workers 8   # (--json: samples)

The dataset (``FolderDataset``, an ImageFolder without torchvision; torchvision's ``ImageFolder`` works the same)
is built once over a ``listing=all`` mount, so it holds every file and its labels never shift.
``tierfs.torch.MountSampler`` makes each ``DataLoader`` epoch one tierfs pass: the indices of the current pass's
files, in serving order.  The workers are started once (``persistent_workers=True``).  The dataset reads its
files with ``loader(path)`` (as ImageFolder does), so the sampler reads cached copies directly (as the mount's
user or root: ``reads.plan`` in ``tierfs status``).  With several processes on one mount, give each ``rank=`` and
``world_size=`` (as ``DistributedSampler``).  A ``DataLoader(drop_last=True)`` (timm's) needs the sampler told
too, ``MountSampler(dataset, batch_size=B, drop_last=True)``: every file of each pass is then read in full batches
and no pass waits.  Without ``--listing all`` the sampler refuses the dataset at once, saying the fix (it would
hold one mini-epoch).  Off a mount (a copy of the data) it shuffles as ``DistributedSampler`` does.
"""

from __future__ import annotations

import sys

from torch.utils.data import DataLoader

from folder_dataset import FolderDataset, collate
from passes import PassReport, parse_args, pass_progress, tierfs_position
from tierfs.torch import MountSampler

if __name__ == "__main__":
    args = parse_args(__doc__, None)
    dataset = FolderDataset(args.root)  # built once
    sampler = MountSampler(dataset)  # the one line (rank=, world_size= for several processes)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                        persistent_workers=args.workers > 0, collate_fn=collate)
    progress = pass_progress(args, args.root)  # one live line per pass on stderr: samples/s, hits, slow tier
    for p in range(args.passes):
        sampler.set_epoch(p)
        batches = iter(loader)  # the sampler starts the pass: it ends the last one (reporting its reads)
        report = PassReport(p, tierfs_position(args.root), progress, passes=args.passes, json_lines=args.json)
        for batch in batches:
            report.add(batch)  # your training step
        report.print()
    sys.exit(0)

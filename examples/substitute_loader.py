"""Recipe: no change at all -- a dataset built once, a plain shuffling DataLoader, a mount with ``substitute``.

    tierfs mount /data/imagenet /mnt/imagenet ... --listing all --substitute
    python examples/substitute_loader.py /mnt/imagenet --passes 8 --batch 64 --workers 8

The training script is the one people write: the dataset built once, ``shuffle=True``, ``persistent_workers``.
Under ``substitute`` each name it opens is served, for the current pass, as a file of the current view in the
same class folder (drawn without replacement), so its reads stay in the fast tier and move the mini-epochs on.
Labels come from the class folders, so they hold; a label kept in a side file keyed by file name would not.
Each epoch here reads every name once (its ``--json`` line has the files actually served, by content).
"""

from __future__ import annotations

import sys

from torch.utils.data import DataLoader

from folder_dataset import FolderDataset, collate
from passes import PassReport, parse_args, pass_progress, tierfs_position

if __name__ == "__main__":
    args = parse_args(__doc__, None)
    dataset = FolderDataset(args.root)  # built once
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                        persistent_workers=args.workers > 0, collate_fn=collate)
    progress = pass_progress(args, args.root)
    for p in range(args.passes):
        report = PassReport(p, tierfs_position(args.root), progress, passes=args.passes, total=len(dataset),
                            json_lines=args.json)
        for batch in loader:
            report.add(batch)  # your training step
        report.print()
    sys.exit(0)

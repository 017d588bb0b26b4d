"""Recipe: a PyTorch DataLoader over a tierfs mount, re-listing the folder every pass.

    python examples/imagefolder_loader.py /mnt/imagenet --passes 8 --batch 64 --workers 8

Each pass builds a new ``FolderDataset`` (an ImageFolder without torchvision), so it follows the current
mini-epoch; ``shuffle=False`` keeps the listing order, which is already the pass's fresh serving order.  Reading
every file of the view ends the pass; after ``rf`` passes tierfs shows the next mini-epoch.
"""

from __future__ import annotations

import sys

from folder_dataset import FolderDataset
from passes import parse_args, run_passes

if __name__ == "__main__":
    sys.exit(run_passes(parse_args(__doc__, None), FolderDataset))

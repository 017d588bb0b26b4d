"""Recipe: the mount's ``.tierfs/order0`` as the file list of a DataLoader (the DALI / tf.data way).

    python examples/order_file_loader.py /mnt/imagenet --passes 8

``order0`` holds the paths of the current pass in serving order, NUL-separated (``order`` is the same one per
line, with names holding a newline quoted; see docs/control.md).  Reading it costs one open instead of a walk
of the tree; read it again at the start of every pass.  Labels come from the sorted class folders.
"""

from __future__ import annotations

import os
import sys

from folder_dataset import FolderDataset
from passes import parse_args, run_passes


def read_order(root: str) -> list[str]:
    """The current pass's paths, relative to the mount root, in serving order."""
    with open(os.path.join(root, ".tierfs", "order0"), "rb") as f:
        return [os.fsdecode(p) for p in f.read().split(b"\0")[:-1]]


if __name__ == "__main__":
    sys.exit(run_passes(parse_args(__doc__, None), lambda root: FolderDataset.from_list(root, read_order(root))))

"""Recipe: the ImageFolder loader with direct reads of cached copies (``tierfs.direct.open_cached``).

    python examples/direct_reads.py /mnt/imagenet --passes 8

The one change from ``imagefolder_loader.py``: files are opened with ``open_cached``, which reads a cached
file's copy on the fast tier directly (no FUSE round trips) and falls back to a plain open for anything else.
It needs the mount's user or root (the cache dir is 0700).  ``reads.direct`` in ``tierfs status`` counts them.
"""

from __future__ import annotations

import sys

from folder_dataset import FolderDataset
from passes import parse_args, run_passes
from tierfs.direct import open_cached


def read_cached(path: str) -> bytes:
    with open_cached(path) as f:
        return f.read()


if __name__ == "__main__":
    sys.exit(run_passes(parse_args(__doc__, None), lambda root: FolderDataset(root, loader=read_cached)))

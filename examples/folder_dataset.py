"""An ImageFolder-like dataset written with torch alone: ``root/CLASS/.../file`` -> (bytes as a tensor, label).

torchvision's ``ImageFolder`` works on a tierfs mount unchanged; this is the same idea without torchvision (and
without decoding images), so the recipes run anywhere torch does.  What matters on a tierfs mount:

- **Build it again every pass.**  The mount shows the current view (mini-epoch); a dataset that listed the
  directory once would keep asking for files of an old view (they still read correctly, but from the slow
  tier).  Listing is cheap, and listing the root is also what tells tierfs a new pass has begun.
- **Labels come from the sorted class folders**, which tierfs always lists (even when a class has no file in
  the current view), so a label never shifts between mini-epochs.
- **Listing order is the serving order** of the current pass; keep it (``shuffle=False``): it is already a
  fresh shuffle of the view every pass.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

__all__ = ["FolderDataset", "collate", "read_bytes"]

#: A directory entry tierfs never lists, skipped anyway so the recipe is safe on any dir.
_HIDDEN = ".tierfs"


def read_bytes(path: str) -> bytes:
    """The default ``loader``: the file's bytes.  Unbuffered: before Python 3.14 a buffered ``open()`` also asks
    whether the file is a terminal, which on any FUSE mount is one more request to the daemon, every file."""
    with open(path, "rb", buffering=0) as f:
        return f.readall()


class FolderDataset(Dataset):
    """Every file under ``root/CLASS/`` with the index of CLASS among the sorted class folders as its label; a
    file is read with ``self.loader(path)``, as torchvision's ImageFolder reads it (``MountSampler`` reads cached
    copies directly through it)."""

    def __init__(self, root: str, loader: Callable[[str], bytes] | None = None) -> None:
        self.root = root
        self.loader = loader or read_bytes
        self.classes = sorted(d.name for d in os.scandir(root) if d.is_dir() and d.name != _HIDDEN)
        self.samples: list[tuple[str, int]] = []
        for label, cls in enumerate(self.classes):
            for dirpath, dirnames, filenames in os.walk(os.path.join(root, cls)):
                dirnames.sort()
                # os.walk keeps the listing order of each directory: the serving order on a tierfs mount
                self.samples += [(os.path.join(dirpath, name), label) for name in filenames]

    @classmethod
    def from_list(cls, root: str, paths: list[str], loader: Callable[[str], bytes] | None = None
                  ) -> FolderDataset:
        """The files ``paths`` (relative to ``root``, in this order), labelled by their class folder."""
        ds = cls.__new__(cls)
        ds.root, ds.loader = root, loader or read_bytes
        ds.classes = sorted(d.name for d in os.scandir(root) if d.is_dir() and d.name != _HIDDEN)
        index = {c: i for i, c in enumerate(ds.classes)}
        ds.samples = [(os.path.join(root, p), index[p.split("/", 1)[0]]) for p in paths]
        return ds

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        path, label = self.samples[i]
        data = self.loader(path)
        return {"path": os.path.relpath(path, self.root), "label": label,
                "data": torch.frombuffer(bytearray(data), dtype=torch.uint8)}


def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples of different lengths: labels stacked, the rest as lists (a real loader would decode and resize)."""
    return {"path": [b["path"] for b in batch], "label": torch.tensor([b["label"] for b in batch]),
            "data": [b["data"] for b in batch]}

"""One rank of tests/mount/test_built_once.py's two-process test, run as its own process: an ImageFolder-equivalent
dataset built once over a ``listing=all`` mount, ``MountSampler(rank, world_size)``, a ``DataLoader`` with 4
workers and ``persistent_workers=True``.

    python sampler_rank.py MOUNTPOINT RANK WORLD_SIZE EPOCHS WAIT DIRECT

DIRECT: 1 lets the sampler read cached copies directly (the dataset has a ``loader``), 0 reads every file
through the mount.  Prints one JSON line per epoch: the mount's pass the sampler served (``passes_total``, its
file count, the position as it started) and every item read, ``[index, class, sha256 of the bytes]``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from torch.utils.data import DataLoader

from tierfs.torch import MountSampler


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class FolderDataset:
    """torchvision's ImageFolder rules (which cannot be imported here): sorted class folders, ``samples`` of
    ``(path, class)`` in sorted order, a file read with ``self.loader(path)``; an item is (index, class, sha256
    of the file's bytes)."""

    def __init__(self, root: str) -> None:
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.samples = [(os.path.join(root, c, f), i) for i, c in enumerate(self.classes)
                        for f in sorted(os.listdir(os.path.join(root, c)))]  # fmt: skip
        self.loader = read_bytes

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[int, int, str]:
        path, label = self.samples[i]
        return i, label, hashlib.sha256(self.loader(path)).hexdigest()


class RecordingSampler(MountSampler):
    """The sampler, and the mount's position as each of its passes starts (read before this rank reads a file of
    the pass, so the pass cannot have ended under it)."""

    def __iter__(self):
        indices = list(super().__iter__())
        st = self.indices.client.status()
        self.started = {"pass": self.indices.last_pass, "pass_files": self.indices.pass_files,
                        "position": [st["epoch"], st["mini_epoch"]]}  # fmt: skip
        return iter(indices)


def main() -> int:
    mnt, rank, world_size, epochs, wait = sys.argv[1], *map(int, sys.argv[2:5]), float(sys.argv[5])
    direct = sys.argv[6] == "1"
    ds = FolderDataset(mnt)  # built once: listing=all lists every file
    sampler = RecordingSampler(ds, rank=rank, world_size=world_size, wait=wait, direct=direct)
    loader = DataLoader(ds, batch_size=5, sampler=sampler, num_workers=4, persistent_workers=True, collate_fn=list)
    print(json.dumps({"files": len(ds)}), flush=True)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        items = [item for batch in loader for item in batch]
        print(json.dumps({**sampler.started, "items": items}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

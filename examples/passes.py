"""The loop every mount recipe shares: per pass, a fresh dataset, a DataLoader over it, one JSON line.

The JSON line (tierfs's epoch, mini-epoch and pass when ``root`` is a tierfs mount, and every sample's path,
label and CRC-32) is what the tests check against the backing dir; a real training loop would take a step on
each batch instead of :meth:`PassReport.add`.
"""

from __future__ import annotations

import argparse
import json
import os
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import DataLoader, Dataset

from folder_dataset import collate


def tierfs_position(root: str) -> dict[str, Any]:
    """(epoch, mini_epoch, pass) from ``root/.tierfs/status`` on a tierfs mount; empty on a plain dir."""
    try:
        with open(os.path.join(root, ".tierfs", "status"), "rb") as f:
            st = json.loads(f.read())
    except OSError:
        return {}
    return {"epoch": st["epoch"], "mini_epoch": st["mini_epoch"], "pass": st["pass"]}


class PassReport:
    """Collects (path, label, crc32 of the bytes) of one pass and prints them as one JSON line."""

    def __init__(self, index: int, position: dict[str, Any]) -> None:
        self.line: dict[str, Any] = {"pass_index": index, **position, "samples": []}

    def add(self, batch: dict[str, Any]) -> None:
        for path, label, data in zip(batch["path"], batch["label"].tolist(), batch["data"], strict=True):
            self.line["samples"].append([path, label, zlib.crc32(data.numpy().tobytes())])

    def print(self) -> None:
        print(json.dumps(self.line), flush=True)


def parse_args(doc: str, argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("root", help="a tierfs mount (any class-folder dataset works too)")
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    return ap.parse_args(argv)


def run_passes(args: argparse.Namespace, make_dataset: Callable[[str], Dataset]) -> int:
    """``args.passes`` passes, each over ``make_dataset(root)`` built at its start (it follows the view)."""
    for p in range(args.passes):
        dataset = make_dataset(args.root)
        report = PassReport(p, tierfs_position(args.root))
        # shuffle=False: the listing (or order file) is already this pass's fresh serving order
        for batch in DataLoader(dataset, batch_size=args.batch, shuffle=False, num_workers=args.workers,
                                collate_fn=collate):
            report.add(batch)
        report.print()
    return 0

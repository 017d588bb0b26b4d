"""The loop every mount recipe shares: per pass, a fresh dataset, a DataLoader over it, its progress line.

Each pass shows one live line on stderr (:mod:`tierfs.client.progress`: samples/s, and on a mount the hit rate,
the slow tier's read rate and the stall seconds; a bar on a terminal, a plain line in a pipe or a log; the
process of rank 0 alone under a launcher).  ``--json`` adds one JSON line per pass on stdout: tierfs's epoch,
mini-epoch and pass when ``root`` is a tierfs mount, and every sample's path, label and CRC-32 -- what the
tests check against the backing dir.  A real training loop would take a step on each batch where
:meth:`PassReport.add` is called.
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
from tierfs.client.progress import MODES, PassProgress


def tierfs_position(root: str) -> dict[str, Any]:
    """(epoch, mini_epoch, pass) from ``root/.tierfs/status`` on a tierfs mount; empty on a plain dir."""
    try:
        with open(os.path.join(root, ".tierfs", "status"), "rb") as f:
            st = json.loads(f.read())
    except OSError:
        return {}
    return {"epoch": st["epoch"], "mini_epoch": st["mini_epoch"], "pass": st["pass"]}


class PassReport:
    """One pass: its progress line (``progress``: started here, ended by :meth:`print`) and, with
    ``json_lines``, (path, label, crc32 of the bytes) of each sample printed as one JSON line at its end."""

    def __init__(self, index: int, position: dict[str, Any], progress: PassProgress | None = None, *,
                 passes: int | None = None, total: int | None = None, json_lines: bool = True) -> None:
        self.line: dict[str, Any] = {"pass_index": index, **position, "samples": []}
        self.json_lines = json_lines
        self.progress = progress
        if progress is not None:
            progress.start(index + 1, passes, total)

    def add(self, batch: dict[str, Any]) -> None:
        """A batch of a folder dataset (``folder_dataset.collate``)."""
        if self.json_lines:
            self.line["samples"] += [[path, label, zlib.crc32(data.numpy().tobytes())]
                                     for path, label, data in zip(batch["path"], batch["label"].tolist(),
                                                                  batch["data"], strict=True)]
        if self.progress is not None:
            self.progress.advance(len(batch["path"]))

    def add_samples(self, samples: list[list[Any]]) -> None:
        """Samples as the JSON line lists them (any recipe's own fields)."""
        if self.json_lines:
            self.line["samples"] += samples
        if self.progress is not None:
            self.progress.advance(len(samples))

    def print(self) -> None:
        if self.progress is not None:
            self.progress.finish()
        if self.json_lines:
            print(json.dumps(self.line), flush=True)


def add_output_args(ap: argparse.ArgumentParser) -> None:
    """``--json`` and ``--progress``: what every recipe prints."""
    ap.add_argument("--json", action="store_true",
                    help="also print one JSON line per pass on stdout: tierfs's position and every sample read")
    ap.add_argument("--progress", choices=MODES, default="auto",
                    help="the live line per pass on stderr (default %(default)s: a bar on a terminal, else a plain "
                    "line every 10 s and one per pass)")


def pass_progress(args: argparse.Namespace, root: str) -> PassProgress:
    """The progress line of a recipe's passes over ``root`` (rank 0's alone under a launcher)."""
    return PassProgress(root, mode=args.progress)


def parse_args(doc: str, argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("root", help="a tierfs mount (any class-folder dataset works too)")
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    add_output_args(ap)
    return ap.parse_args(argv)


def run_passes(args: argparse.Namespace, make_dataset: Callable[[str], Dataset]) -> int:
    """``args.passes`` passes, each over ``make_dataset(root)`` built at its start (it follows the view)."""
    progress = pass_progress(args, args.root)
    for p in range(args.passes):
        dataset = make_dataset(args.root)
        report = PassReport(p, tierfs_position(args.root), progress, passes=args.passes,
                            total=len(dataset), json_lines=args.json)  # type: ignore[arg-type]
        # shuffle=False: the listing (or order file) is already this pass's fresh serving order
        for batch in DataLoader(dataset, batch_size=args.batch, shuffle=False, num_workers=args.workers,
                                collate_fn=collate):
            report.add(batch)  # your training step
        report.print()
    return 0

"""The trainer's side of a tierfs mount: where the current view stands, and ``feedback`` after every pass.

tierfs exposes ``MOUNT/.tierfs/status`` (one JSON object) beside ``MOUNT/.tierfs/control`` (``KEY=VALUE`` lines
and commands).  A trainer started with ``--control MOUNT/.tierfs/control`` reports each pass as one line::

    feedback loss=0.7134 train_err=0.41 val_err=0.62

which feeds the mount's adaptive repeating factor (``arf=score|bollinger``): ``loss`` and ``train_err`` are
the pass's mean training loss and the fraction of its training samples whose top active logit was not a true
label (both from the statistics the training step reduces anyway), ``val_err`` is 1 - P@1 on the held-out
validation points (``--val-fraction`` / ``--val``, :mod:`dslide.heldout`; never the ``--test`` set), and
``score`` is by default the full softmax's cross-entropy on those points (``val_loss``; ``--feedback-score``),
so that ARF steers by held-out data whatever the mount's ``arf_weights`` (a repeated mini-epoch always lowers
the training loss, so a loss-weighted score never says advance; and the held-out loss moves smoothly where
P@1 on a few hundred points moves in steps).  Only finite
metrics are written (tierfs rejects others with EINVAL and the whole line would be lost); a metric the
trainer does not measure is left out.  Each line is one ``write(2)`` ending in a newline, so a line is never
split between two writes.

Only rank 0 talks to the mount: it lists the training directory (so a listing ends tierfs's pass exactly
once), snapshots ``status`` right after listing (the view that pass trains on), and writes the feedback.  With
``--read node`` (a mount on every node, ``peers=mpi``) the first rank of each node does so on its node's mount.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from dslide.comm import Comm
from tierfs.client import Client

__all__ = ["FEEDBACK_SCORES", "PassReporter", "format_feedback", "read_status", "write_control"]

#: What ``score=`` in the feedback line can be: a held-out figure of the record, or none (arf_weights decide).
FEEDBACK_SCORES = ("val_loss", "val_err", "none")

# What the JSON lines carry from tierfs's status (its own position, not the trainer's pass count).
STATUS_FIELDS = ("epoch", "mini_epoch", "pass", "rf")


def read_status(control: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The mount's status object, or None when there is none (not a tierfs control file, unmounted)."""
    try:
        return Client(control).status()
    except (OSError, ValueError):
        return None


def format_feedback(
    loss: float | None = None,
    train_err: float | None = None,
    val_err: float | None = None,
    score: float | None = None,
) -> str | None:
    """``feedback loss=.. train_err=.. val_err=..\\n`` with the finite metrics given, or None if none is."""
    metrics = {"loss": loss, "train_err": train_err, "val_err": val_err, "score": score}
    words = [f"{k}={float(v):.6g}" for k, v in metrics.items() if v is not None and math.isfinite(float(v))]
    return "feedback " + " ".join(words) + "\n" if words else None


def write_control(control: str | os.PathLike[str], line: str) -> None:
    """Write ``line`` to the mount's control file in one ``write(2)`` (through tierfs's control client);
    ``ValueError`` if the mount refuses it (with its reason) or it is not one line, ``OSError`` otherwise."""
    if not line.endswith("\n") or "\n" in line[:-1]:
        raise ValueError(f"a control write is one line ending in a newline, got {line!r}")
    Client(control).write(line, check=False)  # the mount checks it: one parser, the mount's


class PassReporter:
    """The hooks :func:`dslide.train.run_training` takes: ``lister`` for each pass's file list, and the
    ``before_report(record)`` call that adds tierfs's position and the communication split to the JSON line
    and writes the ``feedback`` line.  Every rank calls both; only rank 0 touches the file system (each node's
    first rank, ``per_node``).
    """

    def __init__(
        self,
        comm: Comm,
        control: str | None = None,
        list_files: Callable[[Sequence[str]], list[str]] | None = None,
        score: str = "val_loss",
        per_node: bool = False,
    ) -> None:
        if score not in FEEDBACK_SCORES:
            raise ValueError(f"feedback score must be one of {', '.join(FEEDBACK_SCORES)}, got {score!r}")
        self.comm = comm
        # (``--read node``: the first rank of each node writes to its node's mount; else rank 0 alone)
        self.writes = (comm.node_comm().rank if per_node else comm.rank) == 0
        self.control = control
        self.score = score  # the record's field sent as score=; "none": the mount's arf_weights decide
        self._list_files = list_files
        self._status: dict[str, Any] | None = None
        self.feedback_written = 0

    def lister(self, specs: Sequence[str]) -> list[str]:
        """List the training files (rank 0's call inside the loop's bcast) and snapshot the mount's status."""
        if self._list_files is None:
            from dslide.train import list_train_files

            self._list_files = list_train_files
        files = self._list_files(specs)
        if self.control:
            self._status = read_status(self.control)
        return files

    def __call__(self, record: dict[str, Any]) -> None:
        by_op = getattr(self.comm, "bytes_by_op", None)
        if by_op is not None:
            record["comm_bytes_by_op"] = dict(by_op)
        if not self.writes or not self.control:
            return
        if self._status is not None:
            record["tierfs"] = {k: self._status.get(k) for k in STATUS_FIELDS}
        val_err = record.get("val_err")  # held out of training; never the test set's P@1
        line = format_feedback(
            loss=record.get("loss"),
            train_err=record.get("train_err"),
            val_err=val_err,
            score=None if self.score == "none" else record.get(self.score),
        )
        if line is None:
            return
        try:
            write_control(self.control, line)
        except (OSError, ValueError) as exc:
            # The mount refusing feedback must not stop training; say so once per pass.
            print(f"dslide: {self.control}: feedback not accepted: {exc}", file=sys.stderr)
            return
        self.feedback_written += 1

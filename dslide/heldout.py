"""A held-out split of the training data: what ``val_err`` in tierfs ``feedback`` is measured on.

ARF decides whether repeating a mini-epoch still helps the model, so the error it steers by must come from
data the model does not train on and that stands for the whole data set -- not from the mini-epoch being
repeated (which repeating always improves) and never from the test set a study reports (steering by it would
tune the run to the test points).  A trainer on a tierfs mount only ever sees the current view, so the split
is made point by point as files are read:

* every training point gets a key ``u`` in [0, 1) from ``(seed, file name, index in the file)`` -- the same on
  every pass, rank and mount, so a point is either always held out or never;
* points with ``u < fraction`` are held out: they are never trained on;
* the validation set is the ``capacity`` held-out points with the smallest keys among all files read so far:
  a uniform sample of what has streamed past (a bottom-k sketch, as in reservoir sampling).  Within a
  mini-epoch its files are re-read, no new point enters, and the passes of one mini-epoch are scored on the
  same points; fresh mini-epochs add theirs, so the set comes to stand for the whole data set, and a repeat
  that helps the current mini-epoch at the expense of the others shows as a worse score.

Files are told apart by their base name (``part-00012.txt`` is the same file under the mount and in the
backing dir); a file re-read under a known name is assumed unchanged.  The set is not checkpointed: after
``--resume`` it fills again as files are read.
"""

from __future__ import annotations

import os
import zlib

import numpy as np

from dslide.data import XCData, concat

__all__ = ["HeldOut", "point_keys"]

_TAG = 0x76616C  # "val": keeps the split's stream apart from the training order's


def point_keys(name: str, n: int, seed: int) -> np.ndarray:
    """Uniform keys in [0, 1) of the ``n`` points of the file named ``name`` (its base name counts)."""
    base = os.path.basename(os.fspath(name)).encode("utf-8", "surrogateescape")
    return np.random.default_rng((seed, _TAG, zlib.crc32(base))).random(n)


class HeldOut:
    """Points held out of training, and the validation set drawn from them (see the module docstring)."""

    def __init__(self, fraction: float, capacity: int = 2000, seed: int = 0) -> None:
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"val fraction must be in (0, 1), got {fraction!r}")
        if capacity < 1:
            raise ValueError(f"val points must be >= 1, got {capacity!r}")
        self.fraction = float(fraction)
        self.capacity = int(capacity)
        self.seed = int(seed)
        self._files: dict[str, tuple[np.ndarray, XCData]] = {}  # base name -> (keys, held-out points)
        self._data: XCData | None = None
        self._stale = False

    def split(self, name: str, data: XCData) -> np.ndarray:
        """A boolean mask of the points of ``data`` (the file ``name``) to train on; the rest are held out."""
        keys = point_keys(name, len(data), self.seed)
        held = keys < self.fraction
        base = os.path.basename(os.fspath(name))
        if base not in self._files and held.any():
            rows = np.flatnonzero(held)
            self._files[base] = (keys[rows], data.subset(rows))
            self._stale = True
        return ~held

    @property
    def held_points(self) -> int:
        """Held-out points of all files read so far (the validation set is at most ``capacity`` of them)."""
        return sum(len(k) for k, _ in self._files.values())

    def data(self) -> XCData | None:
        """The validation set: the held-out points with the smallest keys, at most ``capacity``; None if none."""
        if self._stale:
            parts = list(self._files.values())
            keys = np.concatenate([k for k, _ in parts])
            every = concat([d for _, d in parts])
            keep = np.sort(np.argsort(keys, kind="stable")[: self.capacity])
            self._data = every.subset(keep)
            self._stale = False
        return self._data

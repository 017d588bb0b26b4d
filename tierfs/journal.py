"""The position journal: where in the plan the mount stands, so a remount resumes there.

Written atomically (``atomic.atomic_write``) at every pass end and mini-epoch switch and on close, so after a
clean or a killed stop the next mount of the same cache resumes the same epoch, mini-epoch and pass.  Reads
made within the interrupted pass are not journalled: that pass starts over.  Together with the ``data/``
directory (see cache.py) this is all the state a restart needs.  It is read and written through the cache
dir's descriptor (:class:`CacheDir`), never its path: a cache dir swapped for a symlink while mounted is never
written through.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import trio

from sampler.atomic import atomic_write
from tierfs.threads import in_thread
from tierfs.wakeup import Wakeup

__all__ = ["JOURNAL_NAME", "CacheDir", "JournalWriter", "Position", "encode_position", "load_position"]

JOURNAL_NAME = "journal.json"
_VERSION = 1


@dataclass
class Position:
    """Epoch, mini-epoch (index into the epoch's plan) and pass (within the mini-epoch), plus their history."""

    epoch: int = 0
    mini_epoch: int = 0
    pass_index: int = 0
    passes_total: int = 0
    rf_effective: list[int] = field(default_factory=lambda: [0])
    arf_history: list[dict[str, Any]] = field(default_factory=list)
    last_pass: list[int] | None = None  # [epoch, mini_epoch] of the last completed pass (what feedback is about)
    switch_due: bool = False  # a switch waits for the next epoch's plan (made at the next mount's start)


class CacheDir(Protocol):
    """The cache dir, opened once and checked (:class:`tierfs.cache.CacheStore`): ``dir_fd`` (-1 once closed)."""

    dir_fd: int


def load_position(cache_dir: str | int) -> Position | None:
    """The journalled position, or None if there is none or it is unreadable (then the mount starts afresh).
    ``cache_dir``: the cache dir's descriptor (the mount's way), or its path (tools and tests)."""
    name, dir_fd = (JOURNAL_NAME, cache_dir) if isinstance(cache_dir, int) else \
        (os.path.join(cache_dir, JOURNAL_NAME), None)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        with open(fd, "rb") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("version") != _VERSION:
        return None
    try:
        pos = Position(
            epoch=int(raw["epoch"]),
            mini_epoch=int(raw["mini_epoch"]),
            pass_index=int(raw["pass"]),
            passes_total=int(raw.get("passes_total", 0)),
            rf_effective=[int(x) for x in raw.get("rf_effective", [0])] or [0],
            arf_history=list(raw.get("arf_history", [])),
            last_pass=_pair(raw.get("last_pass")),
            switch_due=raw.get("switch_due", False) is True,
        )
    except (KeyError, TypeError, ValueError):
        return None
    if min(pos.epoch, pos.mini_epoch, pos.pass_index) < 0:
        return None
    return pos


def _pair(value: Any) -> list[int] | None:
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v >= 0 for v in value):
        return [int(v) for v in value]
    return None


def encode_position(pos: Position) -> bytes:
    raw = asdict(pos)
    raw["pass"] = raw.pop("pass_index")
    raw["version"] = _VERSION
    return json.dumps(raw, sort_keys=True).encode()


class JournalWriter:
    """Writes the journal off the trio thread: a pass end only hands over the newest position; a background
    task writes it (fsync and all) in a cache thread.  A write that fails (a full cache disk) is kept as
    ``error`` and tried again; the mount goes on serving.  ``flush()`` writes what is pending, at close."""

    def __init__(self, cache: CacheDir) -> None:
        self.cache = cache  # (its descriptor is read at each write: a closed cache dir is an error, not a path)
        self.error: str | None = None
        self._pending: bytes | None = None
        self._wake = Wakeup()

    def save(self, pos: Position) -> None:
        self._pending = encode_position(pos)
        self._wake.notify()

    async def run(self, limiter: trio.CapacityLimiter) -> None:
        while True:
            await self._wake.wait()
            data = self._pending  # stays pending until written: a cancel before the write loses nothing
            if data is None:
                continue
            try:
                await in_thread(self._write, data, limiter=limiter)
                self.error = None
                if self._pending is data:
                    self._pending = None
            except OSError as exc:
                self.error = f"cannot write the journal: {exc.strerror or exc}"
                await trio.sleep(1.0)
                self._wake.notify()

    def _write(self, data: bytes) -> None:
        if self.cache.dir_fd < 0:
            raise OSError(errno.EBADF, "the cache dir is not open")
        atomic_write(JOURNAL_NAME, data, dir_fd=self.cache.dir_fd)

    def flush(self) -> None:
        """Write the pending position now (on close, or where no background task runs); errors are kept."""
        data, self._pending = self._pending, None
        if data is not None:
            try:
                self._write(data)
                self.error = None
            except OSError as exc:
                self.error = f"cannot write the journal: {exc.strerror or exc}"

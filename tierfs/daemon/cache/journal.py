"""The position journal: where in the plan the mount stands, so a remount resumes there.

Written atomically (``atomic.atomic_write``) at every pass end and mini-epoch switch and on close, so after a
clean or a killed stop the next mount of the same cache resumes the same epoch, mini-epoch and pass.  Reads
made within the interrupted pass are not journalled: that pass starts over.  Together with the ``data/``
directory (see store.py) this is all the state a restart needs.  It is read and written through the cache
dir's descriptor (:class:`CacheDir`), never its path: a cache dir swapped for a symlink while mounted is never
written through.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import trio

from sampler.atomic import atomic_write
from tierfs.daemon.cache.index import INDEX_NAME
from tierfs.daemon.runtime.threads import in_thread
from tierfs.daemon.runtime.wakeup import Wakeup
from tierfs.daemon.tree.keeper import TREE_NAME

__all__ = ["JOURNAL_NAME", "CacheDir", "JournalWriter", "Position", "encode_position", "fit_to_plan",
           "load_position"]

log = logging.getLogger("tierfs")

JOURNAL_NAME = "journal.json"
_VERSION = 1
_MOST = 2**40  # no mount counts epochs or passes this far (a pass a millisecond for 34 years): beyond is damage
_LARGEST = 64 << 20  # bytes: a journal holds a few hundred KiB of ARF history at most
_STARTS_AFRESH = "the mount starts over at the first epoch (epoch 0 in status) and scans the backing dir"


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
    #: the nm the mount was asked for (its option, before any adapting): the next mount tells a data set that
    #: changed under the same option from an option that changed (schedule.fit_remount_nm)
    nm_asked: int | None = None


class CacheDir(Protocol):
    """The cache dir, opened once and checked (:class:`tierfs.daemon.cache.store.CacheStore`): ``dir_fd`` (-1 once
    closed)."""

    dir_fd: int


def load_position(cache_dir: str | int) -> Position | None:
    """The journalled position, or None if there is none or it is damaged (then the mount starts afresh).
    ``cache_dir``: the cache dir's descriptor (the mount's way: a damaged journal is said and removed, a missing
    one beside the saved tree or index of an earlier mount said), or its path (tools and tests: only read)."""
    name, dir_fd = (JOURNAL_NAME, cache_dir) if isinstance(cache_dir, int) else \
        (os.path.join(cache_dir, JOURNAL_NAME), None)
    try:
        return _read(name, dir_fd)
    except FileNotFoundError:
        if dir_fd is not None and any(_exists(n, dir_fd) for n in (TREE_NAME, INDEX_NAME)):
            log.warning("the cache dir has no %s but an earlier mount's saved state (%s, %s): the position is lost; "
                        "%s", JOURNAL_NAME, TREE_NAME, INDEX_NAME, _STARTS_AFRESH)
        return None
    except (OSError, ValueError) as exc:
        if dir_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(JOURNAL_NAME, dir_fd=dir_fd)
            why = f"it cannot be read: {exc.strerror or exc}" if isinstance(exc, OSError) else exc
            log.warning("the cache dir's %s is damaged (%s): removed; the position is lost; %s", JOURNAL_NAME, why,
                        _STARTS_AFRESH)
        return None


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except OSError:
        return False


def _read(name: str, dir_fd: int | None) -> Position:
    """The position in the journal ``name``; ``ValueError`` saying what is wrong with a damaged one (cut, not
    JSON, a counter missing, of the wrong type, negative or absurd): none of it is taken as it is."""
    with open(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd), "rb") as f:
        data = f.read(_LARGEST + 1)
    if not data.strip():
        raise ValueError("it is empty")
    if len(data) > _LARGEST:
        raise ValueError(f"it is over {_LARGEST >> 20} MiB")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"it is not JSON: {str(exc)[:80]}") from None
    if not isinstance(raw, dict):
        raise ValueError("it is not a JSON object")
    if type(version := raw.get("version")) is not int or version != _VERSION:
        raise ValueError(f"version {str(version)[:20]}, not {_VERSION}")
    rf_listed = _list(raw.get("rf_effective", [0]), "rf_effective")
    counters = {key: _count(raw.get(key, 0 if key == "passes_total" else None), key)
                for key in ("epoch", "mini_epoch", "pass", "passes_total")}
    rf_effective = [_count(value, "rf_effective") for value in rf_listed]
    history = _list(raw.get("arf_history", []), "arf_history")
    if not all(isinstance(h, dict) for h in history):
        raise ValueError("arf_history holds something other than JSON objects")
    return Position(epoch=counters["epoch"], mini_epoch=counters["mini_epoch"], pass_index=counters["pass"],
                    passes_total=counters["passes_total"], rf_effective=rf_effective or [0],
                    arf_history=history, last_pass=_pair(raw.get("last_pass")),
                    switch_due=raw.get("switch_due", False) is True, nm_asked=_count_or_none(raw.get("nm_asked")))


def _count_or_none(value: Any) -> int | None:
    return value if type(value) is int and 0 < value < _MOST else None


def _count(value: Any, key: str) -> int:
    if type(value) is not int or not 0 <= value < _MOST:  # (not a bool, a float, a string of digits)
        raise ValueError(f"{key} is missing" if value is None else
                         f"{key} is {json.dumps(value)[:40]}, not a count from 0 to 2**40")
    return value


def _list(value: Any, key: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{key} is not a list")
    return value


def fit_to_plan(pos: Position, nm: int, most_passes: int) -> None:
    """Clamp a resumed position into the plan of its epoch (``nm`` mini-epochs, ``most_passes`` a mini-epoch at
    most: ``rf_max``, never below an integer ``rf``), and say so: a mini-epoch past the plan (a lower ``nm`` since,
    or a damaged journal) becomes the epoch's last, from its first pass -- not the next epoch, which would
    skip the rest of this one; a pass past the most a mini-epoch gets becomes its last.  A switch that was due
    (waiting for the next epoch's plan) may be past it: the switch is made."""
    where = f"mini-epoch {pos.mini_epoch + 1} of epoch {pos.epoch + 1}, pass {pos.pass_index + 1}"
    if not nm:
        return  # (a plan of no mini-epochs: nothing to fit)
    if pos.mini_epoch >= nm:
        pos.mini_epoch, pos.pass_index, pos.switch_due = nm - 1, 0, False
    elif pos.pass_index >= most_passes and not pos.switch_due:
        pos.pass_index = most_passes - 1
    else:
        return
    log.warning("%s says %s, past the plan in force (%d mini-epochs of at most %d passes: a lower nm or rf_max "
                "since, or a damaged journal): resuming at mini-epoch %d/%d, pass %d", JOURNAL_NAME, where,
                nm, most_passes, pos.mini_epoch + 1, nm, pos.pass_index + 1)


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
    ``error`` and tried again; the mount goes on serving.  Before that task first runs (opening, engine tests)
    and after ``flush()`` (the mount stopped: what is pending is written) a position is written at once."""

    def __init__(self, cache: CacheDir) -> None:
        self.cache = cache  # (its descriptor is read at each write: a closed cache dir is an error, not a path)
        self.error: str | None = None
        self._pending: bytes | None = None
        self._wake = Wakeup()
        self._running = False  # run() writes in the background (until flush())

    def save(self, pos: Position) -> None:
        self._pending = encode_position(pos)
        self._wake.notify()
        if not self._running:
            self.flush()

    async def run(self, limiter: trio.CapacityLimiter) -> None:
        self._running = True  # (and across a restart after a failure: positions still wait for this task)
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
        """Write the pending position now, and each one saved from now on (the mount stopped: the background task
        is gone); errors are kept."""
        self._running = False
        data, self._pending = self._pending, None
        if data is not None:
            try:
                self._write(data)
                self.error = None
            except OSError as exc:
                self.error = f"cannot write the journal: {exc.strerror or exc}"

"""The protocol between a tierfs mount and its clients: what both sides must agree on, and nothing else.

The daemon and the client side (:mod:`tierfs.client`, what a training job imports) each import this module and
never each other.  It imports only :mod:`tierfs.common.options` (the option table and the one ``KEY=VALUE`` parser) and
the standard library, so a training job loads neither trio, pyfuse3, xxhash nor any daemon module
(tests/unit/test_layering.py checks both).  It holds:

* **the control dir**: ``/.tierfs`` and its files (:data:`CONTROL_DIR`, :data:`CONTROL_FILES`);
* **the control grammar**: what a write to ``/.tierfs/control`` may say (:func:`parse_control`, below) and the
  longest one applied (:data:`CONTROL_WRITE_MAX`); how a write is applied is the daemon's
  (:mod:`tierfs.daemon.coordinator.control_file`);
* **the batch plan**: the ``plan`` file's format (:func:`plan_entry` and :func:`plan_document` write it,
  :func:`parse_plan` reads it; docs/tierfs.md, "Batch plans") and the identity of a copy it names
  (:func:`copy_matches`, the copy opened with :data:`COPY_OPEN_FLAGS`, landed with :data:`COPY_MTIME_NS`);
* **direct reads**: the extended attribute that answers a cached copy's path (:data:`CACHE_PATH_XATTR`).

**The control grammar.**  A write holds lines; each line is a command or ``KEY=VALUE`` items (several per line
allowed)::

    rf=8 advance=strict
    next-pass
    next-pass pass=12 rank=1/4
    advance
    feedback loss=0.71 train_err=0.2 val_err=0.31 [score=0.5]
    consumed 7 0-63,65,70-99

``next-pass pass=P rank=R/W`` says that rank R of a job's W ranks finished its share of the mount's pass P
(``passes_total``): the pass ends for the writer's consumer once all W ranks said so (a ``DataLoader`` with
``drop_last=True`` leaves the last partial batch unread, and no open would end the pass), and the line is
ignored once pass P is over.

``consumed PLAN INDICES`` reports direct reads of a batch plan's copies: INDICES are positions in plan PLAN's
file list, comma-separated numbers and inclusive ranges (:func:`format_indices` writes them).  Settings go
through the one option table and parser in :mod:`tierfs.common.options` (live options only: the cache dir, the backing
dir, the mountpoint and the other mount-time options are refused by name); each value is parsed once
(:class:`Assignments`), and checked against the settings it will change.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any, Protocol

from tierfs.common.options import Settings, parse_assignments, parse_changes

__all__ = ["CACHE_PATH_XATTR", "COMMANDS", "CONTROL_DIR", "CONTROL_FILES", "CONTROL_WRITE_MAX", "COPY_MTIME_NS",
           "COPY_OPEN_FLAGS", "EMPTY_WRITE", "MAX_WORLD", "Assignments", "ControlRequest", "PlanCopy", "RankShare",
           "copy_matches", "format_indices", "parse_control", "parse_indices", "parse_plan", "plan_copy_prefix",
           "plan_document", "plan_entry"]

# ------------------------------------------------------------------------------------------------ the names

#: The control dir at the mount's root, and its files (in the order the daemon numbers their inodes).
CONTROL_DIR = ".tierfs"
CONTROL_FILES = ("control", "status", "order", "metrics", "order0", "plan")

#: The extended attribute a mount answers on a dataset file with the absolute path of its cached copy.
CACHE_PATH_XATTR = b"user.tierfs.cache_path"

# ------------------------------------------------------------------------------------------- control writes

COMMANDS = ("next-pass", "advance", "feedback", "consumed")

#: The longest ``write()`` to the control file that is applied (see
#: :mod:`tierfs.daemon.coordinator.control_file`): below every piece size the kernel cuts a longer one into (its
#: max_write and its pages per request, whatever the buffer's alignment), and 4x the longest ``consumed`` report
#: the client writes.
CONTROL_WRITE_MAX = 64 << 10

EMPTY_WRITE = f"empty control write (expected KEY=VALUE lines or {', '.join(COMMANDS)})"

_FEEDBACK_KEYS = ("loss", "train_err", "val_err", "score")


@dataclass(frozen=True)
class Assignments:
    """``KEY=VALUE`` items of a control write, each value parsed once (live options only); ``ValueError`` naming
    the bad item at :meth:`parse`.  Sent as written (:meth:`lines`): the daemon parses the user's text, not a
    re-rendering of it."""

    items: tuple[tuple[str, str], ...] = ()
    values: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, items: Iterable[tuple[str, str]]) -> Assignments:
        items = tuple(items)
        return cls(items, parse_changes(items, live_only=True))

    def applied_to(self, settings: Settings) -> Settings:
        """``settings`` with these values; ``ValueError`` if the result is not a valid combination."""
        return dataclasses.replace(settings, **self.values)

    def lines(self) -> str:
        return "".join(f"{k}={v}\n" for k, v in self.items)


@dataclass(frozen=True)
class ControlRequest:
    settings: Settings
    changed: frozenset[str] = frozenset()
    commands: tuple[str, ...] = ()  # "next-pass" / "advance", in the order written
    feedback: tuple[dict[str, float], ...] = field(default_factory=tuple)
    consumed: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (plan, indices) reports, in the order written
    shares: tuple[RankShare, ...] = ()  # ``next-pass pass=P rank=R/W`` lines, in the order written


@dataclass(frozen=True)
class RankShare:
    """``next-pass pass=P rank=R/W``: rank ``rank`` of ``world`` finished its share of pass ``passes_total``."""

    passes_total: int
    rank: int
    world: int

    def line(self) -> str:
        return f"next-pass pass={self.passes_total} rank={self.rank}/{self.world}\n"

    @classmethod
    def parse(cls, words: list[str]) -> RankShare:
        usage = "next-pass takes nothing or 'pass=P rank=R/W' (rank R of W finished its share of pass P)"
        got = dict(w.partition("=")[::2] for w in words)
        if len(words) != 2 or set(got) != {"pass", "rank"}:
            raise ValueError(f"{usage}, got {' '.join(words)!r}")
        r, sep, w = got["rank"].partition("/")
        try:
            share = cls(int(got["pass"]), int(r), int(w) if sep else -1)
        except ValueError:
            raise ValueError(f"{usage}, got {' '.join(words)!r}") from None
        if share.passes_total < 0 or not 0 <= share.rank < share.world or share.world > MAX_WORLD:
            raise ValueError(f"{usage} with P >= 0 and 0 <= R < W <= {MAX_WORLD}, got {' '.join(words)!r}")
        return share


#: The most ranks a ``next-pass pass=P rank=R/W`` may count (ranks that share one mount: one node's).
MAX_WORLD = 4096


def parse_indices(text: str) -> list[int]:
    """``"0-3,7"`` -> ``[0, 1, 2, 3, 7]`` (positions in a plan); ``ValueError`` naming the bad part."""
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"consumed: bad index or range {part!r} (expected N or N-M)") from None
        if a < 0 or b < a:
            raise ValueError(f"consumed: bad range {part!r} (expected 0 <= N <= M)")
        out.extend(range(a, b + 1))
    return out


def format_indices(indices: list[int]) -> str:
    """The shortest ``parse_indices`` text for ``indices`` (sorted, runs as ranges)."""
    parts: list[str] = []
    run: list[int] = []
    for i in sorted(set(indices)):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def _parse_consumed(words: list[str]) -> tuple[int, tuple[int, ...]]:
    if len(words) < 2:
        raise ValueError("consumed needs a plan number and indices, e.g. 'consumed 7 0-63,65'")
    try:
        plan = int(words[0])
    except ValueError:
        raise ValueError(f"consumed: the plan must be a number, got {words[0]!r}") from None
    return plan, tuple(parse_indices(",".join(words[1:])))


def _parse_feedback(words: list[str]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for key, text in parse_assignments(" ".join(words)):
        if key not in _FEEDBACK_KEYS:
            raise ValueError(f"feedback: unknown metric {key!r} (expected {', '.join(_FEEDBACK_KEYS)})")
        try:
            v = float(text)
        except ValueError:
            raise ValueError(f"feedback: {key} must be a number, got {text!r}") from None
        if not math.isfinite(v):
            raise ValueError(f"feedback: {key} must be finite, got {text!r}")
        metrics[key] = v
    if not metrics:
        raise ValueError("feedback needs at least one of loss=, train_err=, val_err=, score=")
    return metrics


def parse_control(text: str, settings: Settings) -> ControlRequest:
    """Parse one write against the current ``settings``; ``ValueError`` if any part of it is bad."""
    assignments: list[tuple[str, str]] = []
    commands: list[str] = []
    feedback: list[dict[str, float]] = []
    consumed: list[tuple[int, tuple[int, ...]]] = []
    shares: list[RankShare] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        head = words[0].replace("_", "-").lower()
        if head == "feedback":
            feedback.append(_parse_feedback(words[1:]))
        elif head == "consumed":
            consumed.append(_parse_consumed(words[1:]))
        elif head in ("next-pass", "advance") and len(words) == 1:
            commands.append(head)
        elif head == "next-pass" and "=" not in words[0]:
            shares.append(RankShare.parse(words[1:]))
        elif head in ("next-pass", "advance") and "=" not in words[0]:
            raise ValueError(f"{head} takes no arguments, got {line!r}")
        else:
            assignments.extend(parse_assignments(line))
    for key, value in assignments:
        if value == "" and key in ("next_pass", "advance"):
            raise ValueError(f"{key.replace('_', '-')} is a command: write it on a line of its own")
    new = Assignments.parse(assignments).applied_to(settings)
    if not (assignments or commands or feedback or consumed or shares):
        raise ValueError(EMPTY_WRITE)
    return ControlRequest(new, frozenset(k for k, _ in assignments), tuple(commands), tuple(feedback),
                          tuple(consumed), tuple(shares))


# ------------------------------------------------------------------------------------------- batch plans

#: Every copy's mtime, set when it lands: a write or truncate by anyone moves it to "now", which a check of
#: mtime sees even within the filesystem's timestamp granularity (ctime alone could miss a write made in the
#: same tick as the commit).  A plan carries it (``copy_mtime_ns``) for readers that check copies themselves.
COPY_MTIME_NS = 1_000_000_000

#: how a copy is opened: never through a symlink, and never blocking in ``open`` (a FIFO put at a copy's name
#: would hang a reader; ``O_NONBLOCK`` changes nothing for a regular file), then checked with ``fstat``
COPY_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def copy_matches(st: os.stat_result, size: int, copy_id: tuple[int, int]) -> bool:
    """Whether ``st`` is the copy as committed: a regular file with its size, inode, ctime and landing mtime
    (a write or truncate by anyone moves the mtime or ctime; a replacement changes the inode)."""
    return stat.S_ISREG(st.st_mode) and st.st_size == size and (st.st_ino, st.st_ctime_ns) == copy_id \
        and st.st_mtime_ns == COPY_MTIME_NS


class PlanCopy(Protocol):
    """What a plan says of a copy (the daemon's cache entry is one)."""

    @property
    def name(self) -> str: ...

    @property
    def copy_id(self) -> tuple[int, int]: ...

    @property
    def fp(self) -> tuple[int, int, int, int]: ...


def plan_copy_prefix(data_path: str) -> str:
    """The start of every copy's ``"copy"`` value: the opening quote and the cache's data dir."""
    return encode_basestring_ascii(data_path + os.sep)[:-1]  # (copy names are [0-9a-f-]: never escaped)


def plan_entry(rel: bytes, size: int, copy: PlanCopy | None, copy_prefix: str) -> str:
    """One file of a plan: its mount-relative path, size, and copy (``null``: read it through the mount).  A name
    that is not UTF-8 is decoded with ``surrogateescape`` and written with its lone surrogates escaped
    (``\\udcff``), so ``os.fsencode(json.loads(...))`` gives the name's bytes back.  Written piece by piece with
    the json module's own string encoder: ``json.dumps`` of a list of dicts costs several times more."""
    head = f'{{"path":{encode_basestring_ascii(rel.decode("utf-8", "surrogateescape"))},"size":{size},"copy":'
    if copy is None:
        return head + "null}"
    fp, cid = copy.fp, copy.copy_id
    return (f'{head}{copy_prefix}{copy.name}","copy_id":[{cid[0]},{cid[1]}],'
            f'"fingerprint":[{fp[0]},{fp[1]},{fp[2]},{fp[3]}]}}')


def plan_document(plan_id: int, epoch: int, mini_epoch: int, pass_index: int, passes_total: int,
                  entries: list[str]) -> bytes:
    """The ``plan`` file: one JSON object of the pass, its files (:func:`plan_entry`) in serving order."""
    return (f'{{"plan":{plan_id},"epoch":{epoch},"mini_epoch":{mini_epoch},"pass":{pass_index},'
            f'"passes_total":{passes_total},"copy_mtime_ns":{COPY_MTIME_NS},"files":['
            + ",".join(entries) + "]}\n").encode()


def parse_plan(data: bytes, where: str) -> dict[str, Any]:
    """A ``plan`` file read back; ``ValueError`` naming ``where`` if it is not a plan object."""
    plan = json.loads(data)
    if not isinstance(plan, dict) or "files" not in plan:
        raise ValueError(f"{where} is not a plan object")
    return plan

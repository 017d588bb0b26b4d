"""A training job's live progress: one line per pass on stderr, with what the mount did for it.

    pass 3/8  epoch 1 mini-epoch 2/4: 1,200 samples, 387 samples/s, hits 98.0%, slow tier 12.3M/s, stall 0.0 s

The samples and their rate are the job's own count (:meth:`PassProgress.advance`); the hit rate, the slow tier's
read rate and the readers' stall seconds are the differences of the mount's ``status`` between the pass's
start and now (``reads.hits``/``reads.misses``, ``backing_bytes_read``, ``stall_seconds``), so they need no
counting in the job (reads the mount counts late -- direct reads and plan reports, counted when the job reports
them -- show in a later pass's figures; ``hits -``: none counted yet).  Off a tierfs mount the line has the
samples alone.  Positions count from 1, as
``tierfs status`` does (the JSON's indices count from 0).

How it shows (``mode``):

* ``bar`` -- a tqdm bar redrawn in place, then the pass's line (what a terminal gets with ``auto``);
* ``lines`` -- a plain line every ``interval`` seconds while a pass runs and one at its end: what ``auto`` gives
  when stderr is not a terminal, such as a rank's stderr under ``mpiexec`` (a pipe) or a batch job's log, where
  a redrawn bar would be a wall of carriage returns;
* ``off`` -- nothing.

Only one process of a job shows it: the one whose rank (``rank=``, else ``RANK``, ``OMPI_COMM_WORLD_RANK``,
``PMI_RANK``, ``PMIX_RANK`` or ``SLURM_PROCID`` from the environment) is 0.  The mount's status is read at most
once a second, never per sample.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from tierfs.common.options import format_size

__all__ = ["MODES", "PassFigures", "PassProgress", "launcher_rank", "position"]

#: What ``mode`` may be.
MODES = ("auto", "bar", "lines", "off")

#: Environment variables that launchers (torchrun, Open MPI, MPICH/Hydra, PMIx, Slurm) set to a process's rank.
_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
_STATUS_EVERY_S = 1.0  # the mount's status is read at most this often while a pass runs


def launcher_rank(environ: Mapping[str, str] = os.environ) -> int:
    """This process's rank as its launcher set it; 0 when none did (a single process)."""
    for name in _RANK_VARIABLES:
        value = environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return 0


@dataclass(frozen=True)
class PassFigures:
    """One pass as the progress line shows it (the mount's figures are None off a mount)."""

    samples: int
    seconds: float
    hits: int | None = None
    misses: int | None = None
    slow_tier_bytes: int | None = None
    stall_seconds: float | None = None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def hit_rate(self) -> float | None:
        if self.hits is None or self.misses is None or self.hits + self.misses == 0:
            return None
        return self.hits / (self.hits + self.misses)

    def text(self, *, short: bool = False) -> str:
        """``1,200 samples, 387 samples/s, hits 98.0%, slow tier 12.3M/s, stall 0.0 s``; ``short`` (beside a
        bar, which shows the samples itself): ``387/s hits 98% slow 12.3M/s stall 0.0s``."""
        rate = self.samples_per_s
        if short:
            words = [f"{rate:,.0f}/s" if rate < 10_000 else f"{rate / 1000:,.0f}k/s"]
        else:
            words = [f"{self.samples:,} samples", f"{rate:,.0f} samples/s"]
        hit_rate = self.hit_rate
        if self.hits is not None:
            words.append("hits -" if hit_rate is None else f"hits {100 * hit_rate:.{0 if short else 1}f}%")
        if self.slow_tier_bytes is not None:
            per_s = self.slow_tier_bytes / self.seconds if self.seconds > 0 else 0.0
            words.append(f"{'slow' if short else 'slow tier'} {format_size(per_s)}/s")
        if self.stall_seconds is not None:
            words.append(f"stall {self.stall_seconds:.1f}{'s' if short else ' s'}")
        return " ".join(words) if short else ", ".join(words)


def _counters(status: Mapping[str, Any] | None) -> tuple[int, int, int, float] | None:
    if not status:
        return None
    reads = status.get("reads") or {}
    return (int(reads.get("hits", 0)), int(reads.get("misses", 0)), int(status.get("backing_bytes_read", 0)),
            float(status.get("stall_seconds", 0.0)))


def position(status: Mapping[str, Any] | None) -> str:
    """``epoch 1 mini-epoch 2/4`` from a status object, counted from 1 (empty off a mount)."""
    if not status:
        return ""
    if status.get("policy") == "lru":
        return f"epoch {int(status.get('epoch', 0)) + 1}"
    return f"epoch {int(status.get('epoch', 0)) + 1} mini-epoch {int(status.get('mini_epoch', 0)) + 1}/" \
           f"{status.get('nm', '?')}"


class PassProgress:
    """``start(pass_number, passes)`` once a pass's files are known (after the listing that starts the pass on a
    mount), ``advance(samples)`` as they are trained on, ``finish()`` at the pass's end: it writes the pass's line
    and returns its :class:`PassFigures`.  ``mount``: a path on the tierfs mount read (or None)."""

    def __init__(self, mount: str | os.PathLike[str] | None = None, stream: TextIO | None = None, *,
                 mode: str = "auto", interval: float = 10.0, rank: int | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode must be one of {', '.join(MODES)}, got {mode!r}")
        self._stream = stream if stream is not None else sys.stderr
        if (launcher_rank() if rank is None else rank) != 0:
            mode = "off"  # one process of a job shows the job's progress
        elif mode == "auto":
            mode = "bar" if self._stream.isatty() else "lines"
        self.mode = mode
        self._interval = interval
        self._client: Any = None
        if mount is not None and mode != "off":
            from tierfs.client import Client, NotAMount

            try:
                self._client = Client(mount)
            except (NotAMount, OSError):
                self._client = None  # a plain directory: the samples alone
        self._bar: Any = None
        self._label = ""
        self._t0 = self._last_line = self._last_status = 0.0
        self._start: tuple[int, int, int, float] | None = None
        self._now: tuple[int, int, int, float] | None = None
        self._samples = 0

    def _status(self) -> dict[str, Any] | None:
        if self._client is None:
            return None
        try:
            return self._client.status()
        except (OSError, ValueError):
            return None  # (unmounted meanwhile: the line goes on with the samples)

    def start(self, pass_number: int, passes: int | None = None, total: int | None = None,
              unit: str = "samples") -> None:
        """A pass begins: ``pass_number`` counted from 1 of ``passes``; ``total`` steps of ``unit`` (the bar's
        length; unknown: None)."""
        if self.mode == "off":
            return
        status = self._status()
        self._start = self._now = _counters(status)
        where = position(status)
        self._label = f"pass {pass_number}" + (f"/{passes}" if passes else "") + (f"  {where}" if where else "")
        self._samples = 0
        self._t0 = self._last_line = self._last_status = time.monotonic()
        if self.mode == "bar":
            from tqdm import tqdm

            size = shutil.get_terminal_size()  # (a terminal that does not say its size, such as a fresh pty: 80x24)
            # (within 80 columns: the pass, the bar, the count and the short figures; the position and the unit
            # are on the pass's line at finish())
            self._bar = tqdm(total=total, desc=f"pass {pass_number}" + (f"/{passes}" if passes else ""),
                             file=self._stream, leave=False, ncols=size.columns, nrows=size.lines,
                             mininterval=0.2, smoothing=0,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}{postfix}"
                             if total else "{desc}: {n_fmt}{postfix}")

    def advance(self, samples: int, steps: int | None = None) -> None:
        """``samples`` more trained on, ``steps`` more of the bar's unit (default: ``samples``)."""
        if self.mode == "off":
            return
        self._samples += samples
        now = time.monotonic()
        if self._client is not None and now - self._last_status >= _STATUS_EVERY_S:
            self._last_status = now
            self._now = _counters(self._status()) or self._now
        if self._bar is not None:
            self._bar.set_postfix_str(self.figures(now).text(short=True), refresh=False)
            self._bar.update(samples if steps is None else steps)
        elif self.mode == "lines" and now - self._last_line >= self._interval:
            self._last_line = now
            self._write(f"{self._label}: {self.figures(now).text()} (so far)")

    def figures(self, now: float | None = None) -> PassFigures:
        """The pass so far."""
        seconds = (time.monotonic() if now is None else now) - self._t0
        a, b = self._start, self._now
        if a is None or b is None:
            return PassFigures(self._samples, seconds)
        return PassFigures(self._samples, seconds, hits=b[0] - a[0], misses=b[1] - a[1], slow_tier_bytes=b[2] - a[2],
                           stall_seconds=max(0.0, b[3] - a[3]))

    def finish(self) -> PassFigures | None:
        """The pass ended: its line (the bar is cleared first) and its figures; None when nothing shows."""
        if self.mode == "off":
            return None
        self._now = _counters(self._status()) or self._now
        figures = self.figures()
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()
        self._write(f"{self._label}: {figures.text()}")
        return figures

    def _write(self, line: str) -> None:
        self._stream.write(line + "\n")
        self._stream.flush()

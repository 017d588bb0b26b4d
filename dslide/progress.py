"""A progress bar per pass while ``dslide train`` runs on a terminal (rank 0's stderr): the pass's files, the
samples so far and their rate.  Silent when stderr is not a terminal; the JSON lines on stdout never change."""

from __future__ import annotations

import shutil
from typing import Any, TextIO

__all__ = ["PassProgress"]


class PassProgress:
    """``start(pass_number, passes, files)``, ``advance(points)`` after each file, ``finish()`` before the pass's
    JSON line (the bar is cleared, so the lines stay clean)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._shown = stream.isatty()
        self._bar: Any = None
        self._points = 0

    def start(self, pass_number: int, passes: int, files: int) -> None:
        if not self._shown:
            return
        from tqdm import tqdm

        size = shutil.get_terminal_size()  # (a terminal that does not say its size, such as a fresh pty: 80 x 24)
        self._points = 0
        self._bar = tqdm(total=files, desc=f"pass {pass_number}/{passes}", unit=" files", file=self._stream,
                         leave=False, ncols=size.columns, nrows=size.lines, mininterval=0.2, smoothing=0)

    def advance(self, points: int) -> None:
        if self._bar is not None:
            self._points += points
            rate = self._points / max(1e-9, self._bar.format_dict["elapsed"])
            self._bar.set_postfix_str(f"{self._points:,} samples, {rate:,.0f} samples/s", refresh=False)
            self._bar.update(1)

    def finish(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()
            self._stream.flush()

"""Progress on a terminal while a person waits for a mount: the first mount's scan of the backing dir.

A bar (tqdm) on stderr when it is a terminal -- a foreground mount's, or the terminal a ``--daemon`` mount was
started from, which the daemon's scan reaches through the readiness pipe (see ``tierfs.mount.daemonize``) --
until the mount answers; nothing otherwise (``mount -a``, systemd: the log and systemd's ``STATUS=`` have it).
"""

from __future__ import annotations

import shutil
from typing import Any, TextIO

__all__ = ["ScanProgress"]


class ScanProgress:
    """``update(entries, seconds)`` is the scan's progress callback (``Tree.scan(progress=...)``); ``close()``
    once the mount answers or failed."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._shown = stream.isatty()
        self._bar: Any = None

    def update(self, entries: int, seconds: float) -> None:
        if not self._shown:
            return
        if self._bar is None:
            from tqdm import tqdm

            # (a terminal that does not say its size, such as a fresh pty, is 80 x 24, where tqdm would hide the bar)
            size = shutil.get_terminal_size()
            self._bar = tqdm(desc="tierfs: scanning the backing dir", unit=" entries", file=self._stream,
                             unit_scale=True, smoothing=0, ncols=size.columns, nrows=size.lines, mininterval=0)
        self._bar.update(entries - self._bar.n)

    def close(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()
            self._stream.flush()

"""Progress on a terminal while a person waits for a mount: the first mount's scan of the backing dir.

A bar (tqdm) on stderr when it is a terminal -- a foreground mount's, or the terminal a ``--daemon`` mount was
started from, which the daemon's scan reaches through the readiness pipe (see ``tierfs.daemon.fuse.mount.daemonize``) --
until the mount answers; nothing otherwise (``mount -a``, systemd: the log and systemd's ``STATUS=`` have it).
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any, TextIO

from tierfs.common.options import format_size

if TYPE_CHECKING:
    from tierfs.daemon.tree.tree import ScanCount

__all__ = ["ScanProgress"]

#: The bar's line (within 80 columns for a million files): entries, files and bytes so far, time and rate; with
#: a known total, the share done and the time left.
_UNKNOWN_TOTAL = "{desc}: {n_fmt} entries{postfix} [{elapsed}, {rate_fmt}]"
_KNOWN_TOTAL = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt}{postfix} [{remaining} left, {rate_fmt}]"


class ScanProgress:
    """``update(count)`` is the scan's progress callback (``Tree.scan(progress=...)``, a
    :class:`~tierfs.daemon.tree.tree.ScanCount`): entries so far, their rate, the files and bytes found, and -- when the
    scan knows how many entries to expect -- a bar with its ETA; ``close()`` once the mount answers or failed."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._shown = stream.isatty()
        self._bar: Any = None

    def update(self, count: ScanCount) -> None:
        if not self._shown:
            return
        from tqdm import tqdm

        tqdm_size = tqdm.format_sizeof
        if self._bar is None:
            # (a terminal that does not say its size, such as a fresh pty, is 80 x 24, where tqdm would hide the bar)
            size = shutil.get_terminal_size()
            self._bar = tqdm(desc="tierfs: scanning", unit="", file=self._stream, unit_scale=True,
                             smoothing=0, ncols=size.columns, nrows=size.lines, mininterval=0,
                             bar_format=_UNKNOWN_TOTAL)
        if count.total is not None and self._bar.total != count.total:
            self._bar.total = count.total
            self._bar.bar_format = _KNOWN_TOTAL
        self._bar.set_postfix_str(f"{tqdm_size(count.files)} files, {format_size(count.bytes)}", refresh=False)
        self._bar.update(count.entries - self._bar.n)

    def close(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()
            self._stream.flush()

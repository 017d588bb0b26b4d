"""``dslide train``'s progress on rank 0's stderr: per pass, the files done, the samples and their rate, and on a
tierfs mount the hit rate, the slow tier's read rate and the stall seconds (:mod:`tierfs.client.progress`).

A bar on a terminal; under ``mpiexec`` (a rank's stderr is a pipe) or in a batch log, a plain line every 10 s
and one per pass (``--progress`` chooses).  The JSON lines on stdout never change."""

from __future__ import annotations

from tierfs.client.progress import PassProgress as _MountProgress

__all__ = ["PassProgress"]


class PassProgress(_MountProgress):
    """``start(pass_number, passes, files)``, ``advance(points)`` after each file, ``finish()`` before the pass's
    JSON line (the bar is cleared and the pass's line written, so the JSON lines stay clean)."""

    def start(self, pass_number: int, passes: int | None = None, total: int | None = None,
              unit: str = "files") -> None:
        super().start(pass_number, passes, total, unit)

    def advance(self, samples: int, steps: int | None = 1) -> None:
        super().advance(samples, steps)  # (the bar counts files: one per call)

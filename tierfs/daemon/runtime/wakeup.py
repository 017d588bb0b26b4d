"""``Wakeup``: how a background job of the daemon sleeps until something it cares about changed.

Each job (staging, pushes, revalidation, planning, the journal, lease returns) loops: look for work, do it, or
wait until told that something changed.  A ``notify`` that comes while the job is busy is kept, so the job
never sleeps through a change made between its look and its wait; at worst it looks once more for nothing.
"""

from __future__ import annotations

import trio

__all__ = ["Wakeup"]


class Wakeup:
    """See the module docstring: one waiting task, any number of notifiers (all on the trio thread)."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def notify(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        """Until the next notify, or at once if one came since the last wait returned."""
        await self._event.wait()
        self._event = trio.Event()

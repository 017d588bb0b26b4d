"""The pin keeper: the copies kept on disk for readers that open them without the daemon seeing the open.

A copy the daemon serves itself is pinned by its open handle (:meth:`~tierfs.daemon.cache.store.CacheStore.pin`) until
its release.  Two kinds of reader open copies by path, and for them this one owner holds the pins:

* a **lease**: a copy lent to a direct reader (``DataPath.lend``, the ``user.tierfs.copy`` xattr) stays
  pinned :data:`LEND_SECONDS`, long enough for the reader to open it right after asking;
* a **pass pin**: a copy a batch plan named (batch_plans.py) stays pinned until the pass it was planned in ends (all
  read, ``next-pass``, the root listed again, a switch), once however many plans of that pass name it;
* a **peer's pin**: a copy sent to a peer (peers.py) stays pinned while it is sent.

An eviction or a change of the backing file meanwhile only *dooms* a pinned copy; its name (never reused) is
unlinked on the last unpin (the space it frees, the cache tells the stager).  :meth:`PinKeeper.run`, started in the
mount's nursery, gives leases back when their time is up, also when no further ``lend`` comes to do it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import trio

from tierfs.daemon.cache.store import CacheEntry, CacheStore
from tierfs.daemon.runtime.wakeup import Wakeup

__all__ = ["LEND_SECONDS", "PinKeeper", "PinStatistics"]

LEND_SECONDS = 2.0  # a lent copy stays pinned this long: the reader opens it right after asking


@dataclass(frozen=True)
class PinStatistics:
    leases: int  # copies lent to direct readers and still pinned for them
    pass_pins: int  # copies pinned for the batch plans of the pass that runs (once each)


class PinKeeper:
    """See the module docstring."""

    def __init__(self, cache: CacheStore) -> None:
        self.cache = cache
        self._leases: deque[tuple[float, CacheEntry]] = deque()  # (deadline, copy), in time order
        self._pass: dict[int, CacheEntry] = {}  # id(entry) -> entry: pinned for the pass that runs
        self._wake = Wakeup()

    # ------------------------------------------------------------------------------------------ leases

    def lease(self, entry: CacheEntry, now: float) -> None:
        """Keep ``entry`` pinned until ``now + LEND_SECONDS``: takes over a pin the caller made (the open that
        checked the copy)."""
        self._leases.append((now + LEND_SECONDS, entry))
        if len(self._leases) == 1:
            self._wake.notify()

    def return_leases(self, now: float | None = None) -> None:
        """Unpin the lent copies whose time is up."""
        now = time.monotonic() if now is None else now
        while self._leases and self._leases[0][0] <= now:
            self.cache.unpin(self._leases.popleft()[1])

    async def run(self) -> None:
        """Unpin lent copies when their time is up, until cancelled."""
        while True:
            if not self._leases:
                await self._wake.wait()
                continue
            await trio.sleep(max(0.0, self._leases[0][0] - time.monotonic()))
            self.return_leases()

    # -------------------------------------------------------------------------------------- peers' pins

    def for_peer(self, entry: CacheEntry) -> None:
        """(PinsForPeers) Keep ``entry`` on disk while the peer server sends it."""
        self.cache.pin(entry)

    def peer_done(self, entry: CacheEntry) -> None:
        """(PinsForPeers) Sent: unpin it (a copy evicted meanwhile goes now, and the stager may use the room)."""
        self.cache.unpin(entry)

    # -------------------------------------------------------------------------------------- pass pins

    def pin_for_pass(self, entries: Iterable[CacheEntry]) -> None:
        """Pin each copy until the pass that runs ends (a copy already pinned for it is not pinned again)."""
        pins, pin = self._pass, self.cache.pin
        for e in entries:
            if id(e) not in pins:
                pins[id(e)] = e
                pin(e)

    def pass_over(self) -> None:
        """The pass that ran is over: unpin the copies pinned for it."""
        pins, self._pass = self._pass, {}
        for entry in pins.values():
            self.cache.unpin(entry)

    def statistics(self) -> PinStatistics:
        return PinStatistics(len(self._leases), len(self._pass))

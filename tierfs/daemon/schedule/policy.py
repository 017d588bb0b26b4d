"""The cache policies: what a mount copies in, keeps and evicts -- one object per ``policy`` setting.

The engine and the data path ask their policy and never compare the setting (``policy`` is fixed at mount, so
the object is chosen once from :data:`POLICIES`).

* :class:`MetPolicy` (``met``): the cache holds the current and the next mini-epoch of the sampler's plans.  The
  next one is staged ahead of its readers and pushed into the page cache; a copy of any other file is unwanted
  and goes to make room; an open of a current file that is not cached fetches it, any other is read from the
  backing dir; passes move the mount on (rf, ``advance``).
* :class:`LruPolicy` (``lru``): a read-through cache, the baseline.  Nothing is staged ahead; every open of an
  uncached file copies it in (a big one beside its reader, who is served from the backing meanwhile), and room
  is made by evicting the least recently used unpinned copies.  No plan: passes are counted and never switch.
"""

from __future__ import annotations

import os

import numpy as np

from tierfs.common.options import format_size, format_size_at_least
from tierfs.daemon.cache.store import CacheStore
from tierfs.daemon.schedule.schedule import Schedule

__all__ = ["ADVISE_WHOLE", "POLICIES", "REVALIDATE_AHEAD_MIN", "CachePolicy", "LruPolicy", "MetPolicy"]

ADVISE_WHOLE = 1 << 20  # a copy up to this size is read ahead whole on open; an lru miss over it is copied beside
#: the fewest unread files of the view whose fingerprints are renewed ahead of the readers (a rate of opens not
#: measured yet, a slow reader, a loader that reads the view in an order of its own): a view up to this size is
#: renewed whole, as before; a bigger one (a whole tree of a million files) by this many a round at the least
REVALIDATE_AHEAD_MIN = 65536


class CachePolicy:
    """What the engine and the data path ask a policy (see the module docstring)."""

    name: str
    #: the mount walks the sampler's plans: a stager and a pusher run, passes switch mini-epochs
    walks_plans: bool

    def __init__(self, schedule: Schedule, cache: CacheStore, *, owned: np.ndarray | None = None) -> None:
        self.schedule = schedule
        self.cache = cache
        #: (met with peers) a mask of the files this node owns: their copies stay while the cap allows
        self.owned = owned

    def check_fits(self) -> None:
        """``ValueError`` (naming the file or the fix) if this configuration cannot work."""

    def keeps(self, fidx: int) -> bool:
        """Whether a copy of ``fidx`` is wanted now: the stager may make it, and it stays when it lands."""
        raise NotImplementedError

    def make_room(self, size: int) -> bool:
        """Evict what this policy gives up first; True if ``size`` more bytes fit then."""
        raise NotImplementedError

    def drop_unwanted(self) -> bool:
        """A mini-epoch became current (or the mount opened): evict what is no longer wanted; True if space was
        freed now."""
        raise NotImplementedError

    def fetches_on_open(self, fidx: int) -> bool:
        """Whether an open of uncached ``fidx`` waits for its copy (else it reads the backing file)."""
        raise NotImplementedError

    def copies_beside(self, size: int) -> bool:
        """Whether an uncached open of this size is served from the backing while its copy is made."""
        return False

    def revalidation_candidates(self, ahead_s: float) -> np.ndarray:
        """The files whose fingerprints are worth renewing ahead of the readers, most urgent first: those the
        readers may open within ``ahead_s`` seconds."""
        raise NotImplementedError


class MetPolicy(CachePolicy):
    """Mini-epochs (see the module docstring)."""

    name = "met"
    walks_plans = True

    def check_fits(self) -> None:
        """A copy at most half the cache, and settings that can plan an epoch."""
        sch = self.schedule
        cap, disk = sch.capacity, sch.disk_sizes
        if disk.size and int(disk.max()) * 2 > cap:
            i = int(np.argmax(disk))
            raise ValueError(
                f"capacity must be at least 2 x the largest file's copy ({os.fsdecode(sch.tree.file_path(i))}: "
                f"{int(disk[i])} bytes on the cache disk), got {cap} ({format_size(cap)}); use at least "
                f"{format_size_at_least(sch.capacity_needed(sch.settings.nm, sch.settings.world_size))}"
            )
        sch.check(sch.settings)  # raises ValueError with the reason

    def keeps(self, fidx: int) -> bool:
        return bool(self.schedule.wanted[fidx])  # the current and the next mini-epoch

    def drop_unwanted(self) -> bool:
        wanted = self.schedule.wanted
        return self.cache.evict_unwanted(wanted if self.owned is None else wanted | self.owned)

    def make_room(self, size: int) -> bool:
        self.drop_unwanted()
        if self.owned is not None and not self.cache.can_reserve(size):
            self.cache.evict_lru(size, among=~self.schedule.wanted)  # (owned copies, for the mini-epochs' needs)
        return self.cache.can_reserve(size)

    def fetches_on_open(self, fidx: int) -> bool:
        return bool(self.schedule.current_mask[fidx])

    def revalidation_candidates(self, ahead_s: float) -> np.ndarray:
        """The view's unread files in serving order that the readers may reach within ``ahead_s`` at their
        rate of opens (at least :data:`REVALIDATE_AHEAD_MIN`), then the cached copies of the next mini-epoch.
        (Not the whole view: under ``view=full`` at a million files that was a million ``lstat`` every
        ``revalidate / 2`` seconds, a core's worth of the daemon and of the backing's server, for files nobody
        was about to open; one opened beyond the window gets its own check, as ever.)"""
        sch = self.schedule
        if sch.view is None:
            return np.zeros(0, np.int64)
        nxt = sch.next_files[self.cache.cached(sch.next_files)]
        unread = sch.unread()[:max(REVALIDATE_AHEAD_MIN, int(sch.opens_per_s() * ahead_s))]
        return np.concatenate([unread, nxt.astype(unread.dtype)])  # (int32 file indices: see tree.index_dtype)


class LruPolicy(CachePolicy):
    """A read-through cache (see the module docstring).  No size rule: a file too big for the cache gets no
    reservation and is served from the backing dir."""

    name = "lru"
    walks_plans = False

    def keeps(self, fidx: int) -> bool:
        return not self.schedule.tree.gone[fidx]  # (a file found gone is never copied again)

    def make_room(self, size: int) -> bool:
        """Evict the least recently used unpinned copies until ``size`` more bytes fit."""
        return self.cache.evict_lru(size)

    def drop_unwanted(self) -> bool:
        return False  # every copy stays (a remount keeps the cache) until room is needed

    def fetches_on_open(self, fidx: int) -> bool:
        return True

    def copies_beside(self, size: int) -> bool:
        # the reader would otherwise wait for the whole copy before its first byte
        return size > ADVISE_WHOLE

    def revalidation_candidates(self, ahead_s: float) -> np.ndarray:
        """Every cached copy (there is no serving order to read ahead of)."""
        return np.fromiter(self.cache.entries.keys(), np.int64, len(self.cache.entries))


#: ``policy`` setting -> its class (``walks_plans`` is read before the schedule the policy is made with)
POLICIES: dict[str, type[CachePolicy]] = {"met": MetPolicy, "lru": LruPolicy}

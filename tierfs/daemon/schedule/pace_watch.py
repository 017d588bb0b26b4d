"""Whether staging keeps up with the readers: repetition beyond ``rf`` and stalls, put down to the slow tier.

When the readers consume faster than the slow tier can be staged (the MET paper's ``EB1 > rf x B2``), a mount
either repeats the current mini-epoch beyond ``rf`` (``advance=ready``, up to ``rf_max``) or switches before the
next one is staged and its readers wait (``strict``, or ``ready`` at the ceiling).  Both are the slow tier's
doing, and neither should pass unnoticed: :class:`PaceWatch` is told at every pass end that reached ``rf``
whether the next mini-epoch was staged, counts what was repeated and what stalled, and says -- in ``status``
(``slow_tier``), ``metrics`` and once per episode in the log -- the measured rates and what would fix it
(:func:`remedies`).  An episode ends when :data:`KEEPS_UP_AFTER` mini-epochs in a row are left after at most
``rf`` passes with their successors staged, and no pass end between found staging behind: a hysteresis, so a tier
that is behind in every other mini-epoch (or behind, then in time, in each: ``rf=auto`` raising ``rf`` as it
measures) is one episode -- one warning, and one "keeps up again" once it holds -- not two lines a mini-epoch
(measured: 479 KB of log in 10 minutes).  The state in ``status`` and ``metrics`` follows the same episodes, so an
alert on it does not flap either.  Pure bookkeeping on the trio thread: the engine hands it the figures.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sampler.iomodel import stall_free_rf
from tierfs.common.options import format_size, format_size_at_least

__all__ = ["KEEPS_UP_AFTER", "PaceStatistics", "PaceWatch", "Rates", "remedies"]

log = logging.getLogger("tierfs")

#: Mini-epochs in a row left in time, with no pass end behind between, that end an episode.
KEEPS_UP_AFTER = 2


@dataclass(frozen=True)
class Rates:
    """What a pass end measured, and the settings the remedies are about."""

    staging_bytes_per_s: float  # B2: what staging reads from the slow tier
    consumption_bytes_per_s: float  # EB1: what the readers open
    rf: int  # in force
    rf_setting: int | str
    rf_max: int  # the ceiling in force
    bandwidth: int  # the cap on backing reads (0: none)
    capacity: int
    dataset_bytes: int

    @property
    def rf_needed(self) -> int | None:
        """The IO model's stall-free rf, ``ceil(EB1 / B2)``; None until both rates are measured."""
        s, c = self.staging_bytes_per_s, self.consumption_bytes_per_s
        return stall_free_rf(c, s) if s > 0 and c > 0 else None


@dataclass(frozen=True)
class PaceStatistics:
    """``status.slow_tier``: ``state`` is ``ok``, ``repeating`` (``advance=ready`` repeats beyond ``rf`` while
    the next mini-epoch is staged) or ``stalling`` (a switch came before the next was staged: readers wait on the
    slow tier); the rest is as measured at the last pass end that found staging behind."""

    state: str = "ok"
    since: float | None = None  # wall-clock start of the episode
    episodes: int = 0
    repeats_beyond_rf: int = 0  # passes made beyond rf because the next mini-epoch was not staged
    stalled_switches: int = 0  # switches made before the next mini-epoch was staged
    staging_bytes_per_s: float = 0.0
    consumption_bytes_per_s: float = 0.0
    rf_needed: int | None = None
    why: str | None = None  # the measured cause, in words
    fix: str | None = None  # what would fix it, in words


def remedies(r: Rates) -> str:
    """What would make the slow tier keep up, most direct first."""
    need = r.rf_needed
    out = []
    if need is not None and need > r.rf:
        if r.rf_setting == "auto" or need > r.rf_max:
            out.append(f"rf_max={need}" + ("" if r.rf_setting == "auto" else f" and rf={need}")
                       + " (more repetition than docs/tuning.md measured)")
        else:
            out.append(f"rf={need} (within rf_max={r.rf_max})")
    if r.bandwidth:
        out.append(f"a larger bandwidth cap (now {format_size(r.bandwidth)}/s)")
    out.append("a faster slow tier")
    if r.capacity < 2 * r.dataset_bytes:
        out.append(f"capacity >= {format_size_at_least(2 * r.dataset_bytes)} with nm=1 (the data set stays cached: "
                   "nothing to stage after the first epoch)")
    return ", ".join(out) + ", or accept the stalls (advance=strict makes exactly rf passes)"


def _why(r: Rates) -> str:
    need = r.rf_needed
    ratio = f" (EB1/B2: rf {need} would hide staging; rf is {r.rf}, rf_max {r.rf_max})" if need is not None else ""
    return (f"staging reads the slow tier at {format_size(r.staging_bytes_per_s)}/s, the readers consume "
            f"{format_size(r.consumption_bytes_per_s)}/s{ratio}")


class PaceWatch:
    """See the module docstring.  The engine calls :meth:`behind` or :meth:`kept_up` at every pass end that reached
    ``rf`` (never while the next mini-epoch waits for its epoch's plan: that is the planner, not the tier)."""

    def __init__(self) -> None:
        self._state = "ok"
        self._since: float | None = None
        self._episodes = 0
        self._repeats = 0
        self._stalls = 0
        self._rates: Rates | None = None
        self._in_time = 0  # mini-epochs left in time since the last pass end that found staging behind

    def behind(self, rates: Rates, *, stalled: bool) -> None:
        """The next mini-epoch is not staged at a pass end past ``rf``: repeated (``stalled`` False) or switched to
        all the same (True).  Not while the readers read nothing (passes ended by ``next-pass`` alone): there is
        no reader for the slow tier to be behind, and "the readers consume 0/s" would send a person looking for
        one."""
        if rates.consumption_bytes_per_s <= 0:
            return
        if stalled:
            self._stalls += 1
        else:
            self._repeats += 1
        self._rates = rates
        self._in_time = 0
        if self._state == "ok":
            self._episodes += 1
            self._since = time.time()
            what = "readers wait for what is not staged" if stalled else "mini-epochs are repeated beyond rf"
            log.warning("the slow tier is behind the readers, %s: %s; to fix it: %s", what, _why(rates),
                        remedies(rates))
        self._state = "stalling" if stalled else "repeating"

    def kept_up(self) -> None:
        """A mini-epoch was left after at most ``rf`` passes with its successor staged: the episode is over once
        :data:`KEEPS_UP_AFTER` were in a row."""
        if self._state == "ok":
            return
        self._in_time += 1
        if self._in_time < KEEPS_UP_AFTER:
            return
        log.info("staging keeps up with the readers again (%d mini-epochs in a row staged in time)", self._in_time)
        self._state, self._since, self._in_time = "ok", None, 0

    def statistics(self) -> PaceStatistics:
        r = self._rates
        behind = self._state != "ok" and r is not None
        return PaceStatistics(
            state=self._state, since=self._since, episodes=self._episodes, repeats_beyond_rf=self._repeats,
            stalled_switches=self._stalls,
            staging_bytes_per_s=r.staging_bytes_per_s if r is not None else 0.0,
            consumption_bytes_per_s=r.consumption_bytes_per_s if r is not None else 0.0,
            rf_needed=r.rf_needed if r is not None else None,
            why=_why(r) if behind and r is not None else None,
            fix=remedies(r) if behind and r is not None else None,
        )

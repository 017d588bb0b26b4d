"""The ARF controllers fed by ``feedback`` lines: the mount's own (the anonymous consumer's) and each named
consumer's, each scoring the passes of one mini-epoch at a time (:class:`Arf`); their advance votes are counted
by the pass rule (passes.py).

**Bounded, however much feedback comes.**  A controller keeps the last :data:`sampler.arf.HISTORY_KEPT`
observations (the journal keeps as many), and :class:`ConsumerArfs` keeps the controllers of at most
:data:`ARFS_KEPT` named consumers: a member of the steering group writing feedback lines under ever new consumer
names as fast as she can grows neither (issue 46: 54 -> 707 MB in 20 s before).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sampler.arf import HISTORY_KEPT, Controller, make_controller
from tierfs.common.options import Settings

__all__ = ["ARFS_KEPT", "Arf", "ConsumerArfs"]

#: Named consumers whose ARF controllers are kept: as many as the consumer table keeps consumers
#: (``consumers.MAX_CONSUMERS``); beyond it the one fed longest ago is forgotten.
ARFS_KEPT = 64


class Arf:
    """The ARF controller fed by ``feedback`` lines, and the mini-epoch its per-mini-epoch state is about."""

    def __init__(self, controller: Controller | None = None, history: list[dict[str, Any]] | None = None) -> None:
        self.controller = controller or make_controller("off")
        self.controller.history.extend(list(history or ())[-HISTORY_KEPT:])  # (a journal edited by hand: bounded too)
        self.about: tuple[int, int] | None = None  # (epoch, mini_epoch) of the observations so far

    @staticmethod
    def controller_for(settings: Settings) -> Controller:
        """A fresh controller for ``settings`` (``ValueError`` on a bad combination)."""
        s = settings
        return make_controller(s.arf, wait=s.arf_wait, window=s.arf_window, k=s.arf_k, weights=s.arf_weights)

    @property
    def score(self) -> float | None:
        return self.controller.score

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.controller.history

    def replace(self, controller: Controller) -> None:
        """New ARF settings: a fresh controller that keeps the history."""
        controller.history = self.controller.history
        self.controller = controller
        self.about = None

    def observe(self, metrics: Mapping[str, float], about: tuple[int, int]) -> str:
        """Score one feedback about a pass of mini-epoch ``about`` = (epoch, mini_epoch); returns the decision."""
        if about != self.about:
            self.controller.new_mini_epoch(about[1])
            self.about = about
        decision = self.controller.observe(metrics)
        self.controller.history[-1]["epoch"] = about[0]
        return decision


class ConsumerArfs:
    """The ARF controllers of the named consumers (the anonymous consumer's is the mount's own ``PassRule.arf``),
    each made for the ARF settings in force when it was made: after a change, a consumer's next feedback starts
    a fresh one.  At most :data:`ARFS_KEPT`, the ones fed most recently: a forgotten consumer that reports again
    starts afresh, as after a settings change (its best score and wait counter only; its advance vote is the
    consumer table's)."""

    def __init__(self) -> None:
        self._arfs: dict[str, tuple[tuple[object, ...], Arf]] = {}  # in the order they were last fed

    def __len__(self) -> int:
        return len(self._arfs)

    def of(self, who: str, settings: Settings) -> Arf:
        """Consumer ``who``'s controller, made now if it has none for ``settings``."""
        s = settings
        made_for = (s.arf, s.arf_wait, s.arf_window, s.arf_k, s.arf_weights)
        known = self._arfs.pop(who, None)
        if known is None or known[0] != made_for:
            known = (made_for, Arf(Arf.controller_for(s)))
        self._arfs[who] = known  # (last: the most recently fed)
        if len(self._arfs) > ARFS_KEPT:
            del self._arfs[next(iter(self._arfs))]
        return known[1]

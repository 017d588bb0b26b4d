"""Adaptive repeating factor (ARF) controllers, MET paper §III-C.

API
---
``make_controller(mode, *, rf=None, wait=3, window=8, k=2.0, weights=(1.0, 1.0, 1.0)) -> Controller``
    ``mode`` is ``"off"`` (never advances early), ``"fixed"`` (advances after ``rf`` passes; ``rf=None`` is
    ``"off"``), ``"score"`` or ``"bollinger"``.
``Controller.observe(metrics) -> "continue" | "advance"``
    Call once per finished pass with what the trainer reported, e.g. ``{"loss": 0.7, "train_err": 0.2,
    "val_err": 0.3}``; a ``"score"`` entry is used as is, otherwise score = ``weights · (loss, train_err,
    val_err)`` over the metrics present (lower is better).  ``"advance"`` means: leave this mini-epoch as soon
    as the next one is staged.  The caller still enforces its rf as the maximum number of passes.
``Controller.new_mini_epoch(mini_epoch=None)``
    Call when a new mini-epoch starts; resets the per-mini-epoch state (score: best and wait counter).  The
    optional index labels the following history entries (else they count up from 0).
``Controller.score`` (last score or None), ``Controller.history`` (list of JSON-ready dicts, one per observation:
``mini_epoch``, ``pass``, ``score``, ``decision``, plus ``best``/``wait`` or ``best``/``sigma``/``lower``/``upper``;
only the last :data:`HISTORY_KEPT` observations, so a controller fed for months -- or flooded with feedback --
holds no more).
``parse_weights("1,0.5,0") -> (1.0, 0.5, 0.0)`` for control-file values.

Rules
-----
- score: as in the paper's Fig. 6, a pass that beats the best score of this mini-epoch resets the wait counter;
  otherwise the counter grows and at ``wait`` passes without improvement the controller says advance.  Best and
  counter are per mini-epoch, so the first pass over fresh data is never compared with a score reached on other
  data.
- bollinger: a band of ``k`` times the score's normal movement per pass around the best score of this
  mini-epoch; a repeat whose score rises above the band (repeating has made the model measurably worse on the
  score) says advance.  The normal movement is the root mean square of the last ``window`` changes of the
  score from one pass to the next *within* a mini-epoch, kept across mini-epochs because it models the
  fluctuation of training; until ``window`` changes exist the controller says continue.  The first pass of a
  mini-epoch sets its best and never advances.

Why bollinger is not the paper's rule.  MET (§III-C 2) advances when the score falls *below* the lower band
of the previous ``window`` scores.  Measured with dslide through tierfs (docs/benchmarks.md, "What tiering
costs your model"; score = held-out loss), that rule did the opposite of what ARF is for: the first pass over
a fresh mini-epoch drops the held-out loss below the band, so it left fresh mini-epochs after one pass, and
on a mini-epoch whose repeats raised the loss (over-fitting it) the score never went below the band, so it
repeated that one up to rf (rf used 6, 1, 8, 1, 1, 8, 1, ...).  Measuring a repeat against the mini-epoch's
own best (a per-mini-epoch baseline) with the band as the noise margin asks the question ARF has to answer:
does another pass over *this* data still help?
"""

from __future__ import annotations

import math
import numbers
import re
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Literal

__all__ = [
    "HISTORY_KEPT",
    "METRIC_NAMES",
    "MODES",
    "BollingerController",
    "Controller",
    "FixedController",
    "ScoreController",
    "make_controller",
    "parse_weights",
]

Decision = Literal["continue", "advance"]
MODES = ("off", "fixed", "score", "bollinger")
METRIC_NAMES = ("loss", "train_err", "val_err")
#: Observations a controller's history keeps, the newest (tierfs journals as many): about 0.5 MB of dicts.
HISTORY_KEPT = 1000


def parse_weights(text: str) -> tuple[float, float, float]:
    """``"w_loss,w_train_err,w_val_err"`` (commas, colons or blanks between) -> three non-negative finite
    floats, not all 0: the one parser of ARF weights (the ``arf_weights`` option uses it)."""
    parts = [p for p in re.split(r"[,:\s]+", str(text).strip()) if p]
    try:
        ws = tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError(f"weights must be three numbers loss,train_err,val_err, got {text!r}") from None
    if len(ws) != 3 or any(not math.isfinite(w) or w < 0 for w in ws) or not any(ws):
        raise ValueError(f"weights must be three non-negative numbers loss,train_err,val_err (not all 0), "
                         f"got {text!r}")
    return ws


def _finite_real(w: object) -> bool:
    """Whether ``w`` is a finite real number and not a bool (a weight may come from anywhere: JSON, a list)."""
    return not isinstance(w, bool) and isinstance(w, numbers.Real) and math.isfinite(w)


class Controller:
    """Base: bookkeeping shared by every mode.  Subclasses implement ``_decide``."""

    mode: str = "off"

    def __init__(self, weights: Sequence[float] = (1.0, 1.0, 1.0)) -> None:
        if len(weights) != 3 or not all(map(_finite_real, weights)):
            raise ValueError(f"weights must be three finite numbers (loss, train_err, val_err), got {weights!r}")
        self.weights = tuple(float(w) for w in weights)
        self.history: list[dict[str, Any]] = []
        self.score: float | None = None
        self.mini_epoch = 0
        self.passes = 0  # observations in the current mini-epoch

    def combine(self, metrics: Mapping[str, float]) -> float | None:
        """The score of one observation: ``metrics["score"]`` if given, else the weighted metrics present."""
        if "score" in metrics:
            return _finite("score", metrics["score"])
        present = [
            (w, _finite(name, metrics[name]))
            for w, name in zip(self.weights, METRIC_NAMES, strict=True)
            if name in metrics
        ]
        if not present:
            raise ValueError(f"metrics must hold score or one of {', '.join(METRIC_NAMES)}, got {dict(metrics)!r}")
        return math.fsum(w * v for w, v in present)

    def observe(self, metrics: Mapping[str, float]) -> Decision:
        score = self.combine(metrics)
        self.passes += 1
        decision, extra = self._decide(score)  # type: ignore[arg-type]
        self.score = score
        self.history.append(
            {"mini_epoch": self.mini_epoch, "pass": self.passes, "score": score, "decision": decision, **extra}
        )
        if len(self.history) > HISTORY_KEPT:
            del self.history[:-HISTORY_KEPT]  # (one entry at a time: a move of HISTORY_KEPT pointers)
        return decision

    def new_mini_epoch(self, mini_epoch: int | None = None) -> None:
        """Start a mini-epoch: reset per-mini-epoch state.  ``mini_epoch`` labels the history entries that follow;
        without it the label counts up from 0 (the first call before any observation keeps 0)."""
        if mini_epoch is not None:
            if isinstance(mini_epoch, bool) or not isinstance(mini_epoch, int) or mini_epoch < 0:
                raise ValueError(f"mini_epoch must be an integer >= 0, got {mini_epoch!r}")
            self.mini_epoch = mini_epoch
        elif self.passes or self.history:
            self.mini_epoch += 1
        self.passes = 0
        self._reset()

    def _reset(self) -> None:
        pass

    def _decide(self, score: float) -> tuple[Decision, dict[str, Any]]:
        return "continue", {}


class FixedController(Controller):
    """Fixed rf (the paper's baseline): advance after ``rf`` passes; with ``rf=None`` (mode "off") never."""

    def __init__(self, rf: int | None = None, weights: Sequence[float] = (1.0, 1.0, 1.0)) -> None:
        super().__init__(weights)
        if rf is not None and (isinstance(rf, bool) or not isinstance(rf, int) or rf < 1):
            raise ValueError(f"rf must be an integer >= 1 or None, got {rf!r}")
        self.rf = rf
        self.mode = "off" if rf is None else "fixed"

    def combine(self, metrics: Mapping[str, float]) -> float | None:
        # a fixed rf needs no metrics; it records a score when one is given
        if not any(k in metrics for k in ("score", *METRIC_NAMES)):
            return None
        return super().combine(metrics)

    def _decide(self, score: float | None) -> tuple[Decision, dict[str, Any]]:
        if self.rf is not None and self.passes >= self.rf:
            return "advance", {}
        return "continue", {}


class ScoreController(Controller):
    """Score-based ARF: advance after ``wait`` passes without a better (lower) score in this mini-epoch."""

    mode = "score"

    def __init__(self, wait: int = 3, weights: Sequence[float] = (1.0, 1.0, 1.0)) -> None:
        super().__init__(weights)
        if isinstance(wait, bool) or not isinstance(wait, int) or wait < 1:
            raise ValueError(f"wait must be an integer >= 1, got {wait!r}")
        self.wait = wait
        self.best: float | None = None
        self.waited = 0

    def _reset(self) -> None:
        self.best = None
        self.waited = 0

    def _decide(self, score: float) -> tuple[Decision, dict[str, Any]]:
        if self.best is None or score < self.best:
            self.best = score
            self.waited = 0
        else:
            self.waited += 1
        decision: Decision = "advance" if self.waited >= self.wait else "continue"
        return decision, {"best": self.best, "wait": self.waited}


class BollingerController(Controller):
    """Bollinger-band ARF: advance when a repeat's score rises above this mini-epoch's best by more than ``k``
    times the RMS of the last ``window`` pass-to-pass score changes (see the module docstring)."""

    mode = "bollinger"

    def __init__(self, window: int = 8, k: float = 2.0, weights: Sequence[float] = (1.0, 1.0, 1.0)) -> None:
        super().__init__(weights)
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"window must be an integer >= 2, got {window!r}")
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k) or k < 0:
            raise ValueError(f"k must be a finite number >= 0, got {k!r}")
        self.window = window
        self.k = float(k)
        self.changes: deque[float] = deque(maxlen=window)  # within mini-epochs, kept across them
        self.best: float | None = None
        self.last: float | None = None

    def _reset(self) -> None:
        self.best = None
        self.last = None

    def _decide(self, score: float) -> tuple[Decision, dict[str, Any]]:
        extra: dict[str, Any] = {"best": self.best, "sigma": None, "lower": None, "upper": None}
        decision: Decision = "continue"
        if self.best is not None and len(self.changes) == self.window:
            sigma = math.sqrt(statistics.fmean(c * c for c in self.changes))
            lower, upper = self.best - self.k * sigma, self.best + self.k * sigma
            extra.update(sigma=sigma, lower=lower, upper=upper)
            if score > upper:
                decision = "advance"
        if self.last is not None:
            self.changes.append(score - self.last)
        self.best = score if self.best is None else min(self.best, score)
        self.last = score
        return decision, extra


def make_controller(
    mode: str,
    *,
    rf: int | None = None,
    wait: int = 3,
    window: int = 8,
    k: float = 2.0,
    weights: Sequence[float] = (1.0, 1.0, 1.0),
) -> Controller:
    """The controller for ``mode`` (one of ``MODES``); arguments another mode uses are ignored."""
    if mode == "off":
        return FixedController(None, weights)
    if mode == "fixed":
        return FixedController(rf, weights)
    if mode == "score":
        return ScoreController(wait, weights)
    if mode == "bollinger":
        return BollingerController(window, k, weights)
    raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")


def _finite(name: str, value: object) -> float:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return v

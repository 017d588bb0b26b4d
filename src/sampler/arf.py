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
``mini_epoch``, ``pass``, ``score``, ``decision``, plus ``best``/``wait`` or ``mean``/``lower``/``upper``).
``auto_rf(staging_bytes_per_s, consumption_bytes_per_s) -> int``
    ``rf = ceil(EB1 / B2)``, at least 1: the smallest rf with no stall (``iomodel.stall_free_rf``).
``parse_weights("1,0.5,0") -> (1.0, 0.5, 0.0)`` for control-file values.

Rules
-----
- score: as in the paper's Fig. 6, a pass that beats the best score of this mini-epoch resets the wait counter;
  otherwise the counter grows and at ``wait`` passes without improvement the controller says advance.  Best and
  counter are per mini-epoch, so the first pass over fresh data is never compared with a score reached on other
  data.
- bollinger: the band is the mean ± ``k`` standard deviations (population) of the previous ``window`` scores,
  kept across mini-epochs because it models the normal fluctuation of training; a score below the lower band
  says advance.  Until ``window`` scores exist the controller says continue.
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from sampler.iomodel import stall_free_rf

__all__ = [
    "METRIC_NAMES",
    "MODES",
    "BollingerController",
    "Controller",
    "FixedController",
    "ScoreController",
    "auto_rf",
    "make_controller",
    "parse_weights",
]

Decision = Literal["continue", "advance"]
MODES = ("off", "fixed", "score", "bollinger")
METRIC_NAMES = ("loss", "train_err", "val_err")


def auto_rf(staging_bytes_per_s: float, consumption_bytes_per_s: float) -> int:
    """The smallest stall-free rf from measured rates: ``max(1, ceil(consumption / staging))``."""
    return stall_free_rf(consumption_bytes_per_s, staging_bytes_per_s)


def parse_weights(text: str) -> tuple[float, float, float]:
    """``"w_loss,w_train_err,w_val_err"`` -> a tuple of three finite floats."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError(f"weights must be three comma-separated numbers, got {text!r}") from None
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise ValueError(f"weights must be three comma-separated finite numbers, got {text!r}")
    return values  # type: ignore[return-value]


class Controller:
    """Base: bookkeeping shared by every mode.  Subclasses implement ``_decide``."""

    mode: str = "off"

    def __init__(self, weights: Sequence[float] = (1.0, 1.0, 1.0)) -> None:
        if len(weights) != 3 or not all(
            isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w) for w in weights
        ):
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
    """Bollinger-band ARF: advance when the score falls below mean - k * std of the previous ``window`` scores."""

    mode = "bollinger"

    def __init__(self, window: int = 8, k: float = 2.0, weights: Sequence[float] = (1.0, 1.0, 1.0)) -> None:
        super().__init__(weights)
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"window must be an integer >= 2, got {window!r}")
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k) or k < 0:
            raise ValueError(f"k must be a finite number >= 0, got {k!r}")
        self.window = window
        self.k = float(k)
        self.scores: deque[float] = deque(maxlen=window)

    def _decide(self, score: float) -> tuple[Decision, dict[str, Any]]:
        extra: dict[str, Any] = {"mean": None, "lower": None, "upper": None}
        decision: Decision = "continue"
        if len(self.scores) == self.window:
            mean = statistics.fmean(self.scores)
            std = statistics.pstdev(self.scores, mu=mean)
            lower, upper = mean - self.k * std, mean + self.k * std
            extra = {"mean": mean, "lower": lower, "upper": upper}
            if score < lower:
                decision = "advance"
        self.scores.append(score)
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
